"""Helpers sidebyside.py imports: a manual CUDA graph of eager, and a closed-loop load."""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch


def cuda_graph_runner(model: torch.nn.Module, args: tuple) -> Any:
    static = tuple(a.clone() for a in args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(3):
            model(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.inference_mode():
        out = model(*static)

    def run() -> Any:
        g.replay()
        return out

    return run


async def closed_loop(call: Any, callers: int, seconds: float) -> dict:
    stop = time.perf_counter() + seconds
    done = 0
    lags: list[float] = []

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    async def lag() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t - 0.001) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(lag(), *(worker() for _ in range(callers)))
    torch.cuda.synchronize()
    el = time.perf_counter() - t0
    lags.sort()
    p99 = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
    return {"calls_per_s": round(done / el, 1), "lag_p99_ms": round(p99, 2),
            "lag_median_ms": round(statistics.median(lags), 2) if lags else 0.0}
