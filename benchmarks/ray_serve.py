"""Ray Serve scale-out: throughput of 1 vs 2 replicas, and the latency Serve's proxy adds.

    python -m benchmarks.ray_serve [--seconds 10] [--concurrency 16]

Two models, exported here: `mlp` (a 256-wide, 8-layer MLP on one row: compute, so replicas
can add throughput) for throughput, and `affine` (4 -> 3) for latency, where the time is all
transport. Throughput: `concurrency` httpx clients post `mlp` requests for `seconds` through
Serve's proxy, with 1 then 2 replicas (each replica: 1 intra-op thread, 2 frames). Latency:
sequential `affine` requests, median and p99, to `asyncgraph serve`'s app on uvicorn in a
subprocess and to Serve's proxy with 1 replica; the difference is the proxy hop. Every answer
is checked against eager PyTorch. Ray runs locally with the dashboard off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x.expand(64, 256)).sum(dim=0, keepdim=True)
        return out


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


def export_models(root: Path) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mlp, affine = MLP().eval(), Affine().eval()
    torch.export.save(torch.export.export(mlp, (torch.randn(1, 256),)), root / "mlp.pt2")
    torch.export.save(torch.export.export(affine, (torch.randn(1, 4),)), root / "affine.pt2")
    return {"mlp": mlp, "affine": affine}


def body(x: torch.Tensor) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.reshape(-1).tolist()}]}


def check(model: torch.nn.Module, x: torch.Tensor, response: httpx.Response) -> None:
    response.raise_for_status()
    got = np.array(response.json()["outputs"][0]["data"], dtype=np.float32)
    with torch.no_grad():
        want = model(x).numpy().reshape(-1)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError("a wrong answer")


async def throughput(url: str, model: torch.nn.Module, seconds: float, concurrency: int) -> float:
    x = torch.randn(1, 256)
    payload = body(x)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        check(model, x, await client.post("/v2/models/mlp/infer", json=payload))
        deadline = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                r = await client.post("/v2/models/mlp/infer", json=payload)
                r.raise_for_status()
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def latency(url: str, model: torch.nn.Module, n: int) -> tuple[float, float]:
    x = torch.randn(1, 4)
    payload = body(x)
    with httpx.Client(base_url=url, timeout=60) as client:
        check(model, x, client.post("/v2/models/affine/infer", json=payload))
        for _ in range(20):
            client.post("/v2/models/affine/infer", json=payload)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            client.post("/v2/models/affine/infer", json=payload).raise_for_status()
            times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3


def single_server_latency(root: Path, model: torch.nn.Module, n: int) -> tuple[float, float]:
    port = "8791"
    cmd = [sys.executable, "-m", "asyncgraph.cli.main", "serve", str(root / "affine.pt2"),
           "--port", port, "--threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("asyncgraph serve did not start")
            time.sleep(0.2)
        return latency(url, model, n)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=300, help="sequential, for latency")
    args = parser.parse_args()

    import ray
    from ray import serve

    from asyncgraph.ray import build_app
    from asyncgraph.ray.proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    from asyncgraph.runtime.config import ExecutorConfig

    root = Path(tempfile.mkdtemp(prefix="asyncgraph-ray-bench-"))
    models = export_models(root)
    rows: list[tuple[str, str]] = []
    median, p99 = single_server_latency(root, models["affine"], args.requests)
    rows.append(("asyncgraph serve, sequential affine",
                 f"median {median:.2f} ms, p99 {p99:.2f} ms"))

    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8792})
        url = "http://127.0.0.1:8792"
        config = ExecutorConfig(max_concurrent_executions=2, intra_op_threads=1)
        for replicas in (1, 2):
            app = build_app({"mlp": root / "mlp.pt2", "affine": root / "affine.pt2"},
                            num_replicas=replicas, executor_config=config,
                            ray_actor_options={"num_cpus": 0.5}, metrics_interval_s=None)
            serve.run(app, name="bench", route_prefix="/")
            if replicas == 1:
                median_r, p99_r = latency(url, models["affine"], args.requests)
                rows.append(("Ray Serve proxy, 1 replica, sequential affine",
                             f"median {median_r:.2f} ms (+{median_r - median:.2f} ms), "
                             f"p99 {p99_r:.2f} ms"))
            rate = asyncio.run(throughput(url, models["mlp"], args.seconds, args.concurrency))
            rows.append((f"Ray Serve, {replicas} replica(s), mlp x {args.concurrency} clients",
                         f"{rate:.0f} req/s"))
            serve.delete("bench")
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()  # type: ignore[no-untyped-call]
    width = max(len(r[0]) for r in rows)
    for what, figure in rows:
        print(f"{what:<{width}}  {figure}")


if __name__ == "__main__":
    main()
