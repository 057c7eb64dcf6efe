"""Requests per second over gRPC (raw contents) and HTTP (binary tensor data), same server.

    python -m benchmarks.serve_grpc                     # 1000 requests each, 1 and 16 in flight
    python -m benchmarks.serve_grpc -n 2000 --concurrency 1 --rounds 3

One `asyncgraph serve MODEL --port P --grpc-port G` process (uvloop, default settings) serves
a small MLP (FP32 [1, 16] -> Linear 16x64 -> ReLU -> Linear 64x16). One client process sends
`-n` requests over each transport with the stock async clients (tritonclient.grpc.aio with
raw_input_contents; tritonclient.http.aio with binary data in and out), `--concurrency` in
flight at a time, alternating transports per round; each round starts with 50 warm-up
requests. Printed per transport and round: requests per second and the p50 and p99 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _model(path: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)
    ).eval()
    torch.export.save(torch.export.export(model, (torch.randn(1, 16),)), path)


async def _run(send: object, n: int, concurrency: int) -> list[float]:
    times: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:
            start = time.perf_counter()
            await send()  # type: ignore[operator]
            times.append(time.perf_counter() - start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


async def _bench(http_port: int, grpc_port: int, n: int, concurrency: int, rounds: int) -> None:
    import tritonclient.grpc.aio as tga
    import tritonclient.http.aio as tha

    x = np.random.default_rng(0).standard_normal((1, 16), dtype=np.float32)
    grpc_client = tga.InferenceServerClient(f"{HOST}:{grpc_port}")
    http_client = tha.InferenceServerClient(f"{HOST}:{http_port}", conn_limit=concurrency)
    g_in = tga.InferInput("input", [1, 16], "FP32")
    g_in.set_data_from_numpy(x)
    h_in = tha.InferInput("input", [1, 16], "FP32")
    h_in.set_data_from_numpy(x, binary_data=True)
    h_out = [tha.InferRequestedOutput("output_0", binary_data=True)]

    async def over_grpc() -> None:
        await grpc_client.infer("mlp", [g_in])

    async def over_http() -> None:
        await http_client.infer("mlp", [h_in], outputs=h_out)

    try:
        for r in range(rounds):
            for label, send in (("grpc raw", over_grpc), ("http binary", over_http)):
                await _run(send, 50, concurrency)
                start = time.perf_counter()
                times = await _run(send, n, concurrency)
                wall = time.perf_counter() - start
                times.sort()
                print(f"round {r + 1} {label:12s} concurrency {concurrency:3d}: "
                      f"{n / wall:8.0f} req/s  p50 {statistics.median(times) * 1e3:6.2f} ms  "
                      f"p99 {times[int(len(times) * 0.99) - 1] * 1e3:6.2f} ms", flush=True)
    finally:
        await grpc_client.close()
        await http_client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mlp.pt2"
        _model(path)
        http_port, grpc_port = _free_port(), _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph.cli.main", "serve", str(path),
             "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    socket.create_connection((HOST, http_port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the server did not start: {proc.stderr}") from None
                    time.sleep(0.2)
            for concurrency in args.concurrency:
                asyncio.run(_bench(http_port, grpc_port, args.n, concurrency, args.rounds))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
