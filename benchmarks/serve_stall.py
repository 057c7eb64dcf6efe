"""How long one large request body stalls the whole server (issue 39, item 8).

    python -m benchmarks.serve_stall                       # every body kind, 64 MB
    python -m benchmarks.serve_stall --mb 16 --kind floats

A server (`asyncgraph.serve.run`, uvloop, default settings but the ones given) runs in a child
process with a model taking FP32 [batch, 1024]. One client sends a large body; meanwhile
another polls `GET /v2/health/live` on a keep-alive connection, one request every 5 ms, from
before the body is sent until its answer came. Printed per body kind: the big request's
status and time, and the health checks' latency during it (max, p99, median, count): the
stall a health check sees.

Body kinds (each about --mb megabytes before compression):

- floats: a valid JSON request, its data a flat array of random FP32 values;
- nested: the same values as nested rows ([[...], [...]]);
- junk: a valid-looking request with an extra field holding `[],` repeated;
- gzip-junk: `junk`, gzip-compressed (a few hundred KB on the wire);
- binary: the same values as Triton's binary tensor data.

Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

HOST = "127.0.0.1"
WIDTH = 1024
POLL_S = 0.005
MAX_POLLS = 200_000
REQUEST_TIMEOUT_S = 120.0
KINDS = ("floats", "nested", "junk", "gzip-junk", "binary")


# -- the server (child process) ---------------------------------------------------------------


def serve(port: int, options: dict[str, Any]) -> None:
    import torch

    from asyncgraph import Executor
    from asyncgraph.serve import create_app, run

    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1)

    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    ep = torch.export.export(Sum(), (torch.randn(2, WIDTH),), dynamic_shapes=({0: batch},))
    run(create_app({"m": Executor(ep)}, close_executors=True, **options), HOST, port,
        log_level="warning")


# -- the client -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def read_response(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length, read within the deadline."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without an answer (got {buf[:80]!r})")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed mid-body")
        rest += chunk
    return status, rest[:length]


def body_for(kind: str, mb: float) -> tuple[bytes, dict[str, str]]:
    target = int(mb * (1 << 20)) - 4096  # under a limit of exactly --mb
    rng = np.random.default_rng(0)
    if kind in ("junk", "gzip-junk"):
        pad = b"[]," * (target // 3)
        body = (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2]}],'
                b'"junk":[' + pad + b'[]]}')
        if kind == "gzip-junk":
            return gzip.compress(body, 9), {"Content-Encoding": "gzip"}
        return body, {}
    sample = rng.standard_normal((16, WIDTH), dtype=np.float32)
    row_bytes = 4 * WIDTH if kind == "binary" else len(json.dumps(sample.tolist())) / 16
    rows = max(1, int(target / (row_bytes * 1.01)))
    x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
    if kind == "binary":
        header = json.dumps({"inputs": [{
            "name": "x", "datatype": "FP32", "shape": [rows, WIDTH],
            "parameters": {"binary_data_size": x.nbytes}}]}).encode()
        return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    data = x.tolist() if kind == "nested" else x.reshape(-1).tolist()
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, WIDTH], "data": data}]}
    return json.dumps(doc).encode(), {}


def measure(port: int, kind: str, mb: float) -> dict[str, Any]:
    body, headers = body_for(kind, mb)
    latencies: list[float] = []
    stop = threading.Event()
    errors: list[str] = []

    def poll() -> None:
        with socket.create_connection((HOST, port), timeout=REQUEST_TIMEOUT_S) as sock:
            for _ in range(MAX_POLLS):
                if stop.is_set():
                    return
                started = time.monotonic()
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: b\r\n\r\n")
                try:
                    status, _ = read_response(sock, started + REQUEST_TIMEOUT_S)
                except (OSError, ConnectionError) as exc:
                    errors.append(f"health: {exc}")
                    return
                if status != 200:
                    errors.append(f"health: {status}")
                latencies.append(time.monotonic() - started)
                time.sleep(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.3)  # a baseline of polls before the body
    before = len(latencies)
    head = (f"POST /v2/models/m/infer HTTP/1.1\r\nHost: b\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    started = time.monotonic()
    status, answer = -1, b""
    try:
        with socket.create_connection((HOST, port), timeout=REQUEST_TIMEOUT_S) as sock:
            sock.sendall(head + body)
            status, answer = read_response(sock, started + REQUEST_TIMEOUT_S)
    except (OSError, ConnectionError) as exc:
        errors.append(f"big request: {exc}")
    elapsed = time.monotonic() - started
    time.sleep(0.1)
    stop.set()
    poller.join(REQUEST_TIMEOUT_S)
    during = sorted(latencies[before:]) or [0.0]
    message = "" if status == 200 else answer[:160].decode("utf-8", "replace")
    return {
        "kind": kind, "wire_bytes": len(body), "status": status, "request_s": elapsed,
        "health_max_ms": during[-1] * 1e3,
        "health_p99_ms": during[min(len(during) - 1, int(len(during) * 0.99))] * 1e3,
        "health_p50_ms": statistics.median(during) * 1e3, "health_n": len(during),
        "errors": errors, "message": message,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0, help="body size before compression")
    parser.add_argument("--kind", action="append", choices=KINDS, help="repeatable; all")
    parser.add_argument("--option", action="append", default=[],
                        help="create_app option NAME=INT, e.g. max_json_bytes=67108864")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = {k: int(v) for k, _, v in (o.partition("=") for o in args.option)}
    if args.serve is not None:
        serve(args.serve, options)
        return
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.serve_stall", "--serve", str(port),
         *(f"--option={o}" for o in args.option)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for _ in range(600):  # up to 60 s to start
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                if child.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.1)
        print(f"{'kind':10} {'wire MB':>8} {'status':>6} {'request s':>9} "
              f"{'health max ms':>13} {'p99 ms':>8} {'p50 ms':>7} {'polls':>6}")
        for kind in args.kind or KINDS:
            r = measure(port, kind, args.mb)
            print(f"{r['kind']:10} {r['wire_bytes'] / (1 << 20):8.2f} {r['status']:>6} "
                  f"{r['request_s']:9.2f} {r['health_max_ms']:13.1f} {r['health_p99_ms']:8.1f} "
                  f"{r['health_p50_ms']:7.1f} {r['health_n']:>6}"
                  + (f"  {r['message']}" if r["message"] else "")
                  + (f"  errors: {r['errors']}" if r["errors"] else ""), flush=True)
    finally:
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


if __name__ == "__main__":
    main()
