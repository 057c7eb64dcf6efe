"""`asyncgraph serve` as a process: its address is bound before anything loads, and SIGTERM
drains like SIGINT (issue 37 item 4).

Each test starts the console script in a subprocess on 127.0.0.1, reads its output on a thread,
and bounds every wait by WAIT_S.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serving import Served, save_linear, serve

pytestmark = pytest.mark.usefixtures("leak_check")

WAIT_S = 60.0


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_linear(tmp_path_factory.mktemp("models") / "lin.pt2")


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_error_line_before_anything_loads(model_file: Path) -> None:
    """Before: the start banner, the model loaded and calibrated, then uvicorn's `ERROR:
    [Errno 98] ... address already in use` and exit 3. Now: one `error:` line naming the
    port, exit 1, nothing loaded."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "asyncgraph.cli.main", "serve", str(model_file),
             "--port", str(port)],
            capture_output=True, text=True, timeout=WAIT_S,
            env={**os.environ, "COLUMNS": "200"},
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: cannot listen on 127.0.0.1:{port}: port {port} is in use by another process "
        f"(choose another with --port)"
    ], proc.stderr
    # nothing was loaded, calibrated or served: no banner, no uvicorn line
    assert proc.stdout.strip() == "", proc.stdout


def _partial_request(url: str, body: bytes) -> socket.socket:
    """An inference request on a connection of its own, sent but for its body's last byte:
    the server has it in flight (admitted, reading its body) until that byte comes."""
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=WAIT_S)
    head = (
        f"POST /v2/models/lin/infer HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    conn.sendall(head + body[:-1])
    return conn


def _response(conn: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        chunk = conn.recv(65536)
        assert chunk, rest
        rest += chunk
    return int(head.split()[1]), rest


def _queued(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    found = re.search(r'^asyncgraph_queued_requests\{model="lin"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/v2/health/live", timeout=1.0)
    except httpx.TransportError:
        return True
    return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_drains_the_requests_in_flight_and_exits_0(
    model_file: Path, sig: signal.Signals
) -> None:
    """Before, SIGTERM (what container runtimes send) ended the process with 143 after the
    drain. Now it ends as SIGINT does: new connections are refused, the request in flight is
    answered 200, the executors are closed, exit 0."""
    body_doc: dict[str, Any] = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4],
                                            "data": [0.5] * 8}]}
    body = httpx.Request("POST", "http://x", json=body_doc).content
    with serve(str(model_file), "--port", "0") as served:
        url = served.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        conn = _partial_request(url, body)
        with conn:
            deadline = time.monotonic() + WAIT_S
            while _queued(url) < 1:
                assert time.monotonic() < deadline, "the request never reached the app"
                time.sleep(0.01)
            served.proc.send_signal(sig)
            served.wait_for(r"Shutting down")
            deadline = time.monotonic() + WAIT_S
            while not _refuses_connections(url):  # no new connections while it drains
                assert time.monotonic() < deadline, "still accepting connections"
                time.sleep(0.05)
            assert served.proc.poll() is None  # still draining: its request is in flight
            conn.sendall(body[-1:])
            status, payload = _response(conn)
        assert status == 200, payload
        assert b'"outputs"' in payload
        assert served.proc.wait(timeout=WAIT_S) == 0, served.output()
        output = served.output()
    assert "Finished server process" in output and "server stopped" in output, output
    assert "Traceback" not in output, output


_WRAPPED_SERVE = """
import atexit, sys
atexit.register(print, "atexit ran", flush=True)

class TornDown:
    def __del__(self):
        print("torn down", flush=True)

_witness = TornDown()  # collected by CPython's teardown of __main__, if that runs
from asyncgraph.cli.main import main
sys.argv = ["asyncgraph", "serve", *sys.argv[1:]]
main()
"""


@pytest.mark.timeout(180)
def test_a_stopped_server_leaves_without_the_interpreters_teardown(model_file: Path) -> None:
    """Once the server has stopped and closed what it holds, the process ends without
    CPython's module teardown (0.6 s of torch's and sympy's globals on 2 cores): the atexit
    handlers run, the teardown does not."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRAPPED_SERVE, str(model_file), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    served = Served(proc)
    try:
        served.wait_for(r"Application startup complete")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, served.output()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        served.reader.join(timeout=WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()
    output = served.output()
    assert "server stopped" in output and "atexit ran" in output, output
    assert "torn down" not in output, output
