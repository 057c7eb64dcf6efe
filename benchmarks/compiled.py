"""Compiled segments against the plain graph: the encoder of the suite, one caller.

    python -m benchmarks.compiled [--rounds 15] [--calls 50]

Compiles the 70-node export graph of asyncgraph/bench/transformer.py (hidden 128, 2 layers,
seq 16, batch 1) with `--segments whole` and `auto` (a minute or two on 2 cores: compile time and
package size are printed), checks that each agrees with the plain Executor, then times the
three Executors round by round in a new random order each round; medians of per-call times,
ratios against the plain graph measured in the same run. A diagnostic, not part of
`asyncgraph bench`: compiling is too slow for the suite's routine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import asyncgraph
from asyncgraph.bench.models import exported_encoder
from asyncgraph.compiled import compile_program


async def _calls(ex: asyncgraph.Executor, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await ex.execute(x)
    return (time.perf_counter() - start) / calls


async def run(rounds: int, calls: int, workdir: Path) -> None:
    _, ep = exported_encoder(128, 2, 16, False)
    x = torch.randn(1, 16, 128)
    executors = {"plain": asyncgraph.Executor(ep)}
    for mode in ("whole", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's export-time advice
            report = compile_program(ep, workdir / f"encoder.{mode}.aoti.pt2", mode)
        print(f"{mode}: {len(report.segments)} segments, {report.nodes_compiled}/"
              f"{report.nodes_total} nodes compiled in {report.compile_s:.1f} s, package "
              f"{report.package_bytes / 1e6:.1f} MB")
        executors[mode] = asyncgraph.load(report.path, trust_compiled=True)
    try:
        expected = await executors["plain"].execute(x)
        for ex in executors.values():
            torch.testing.assert_close(await ex.execute(x), expected, rtol=1e-4, atol=1e-4)
            for _ in range(20):  # warm-up, profiling and placement decisions
                await ex.execute(x)
        samples: dict[str, list[float]] = {name: [] for name in executors}
        order = list(executors)
        rng = random.Random(0)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                samples[name].append(await _calls(executors[name], x, calls))
        plain = statistics.median(samples["plain"])
        for name, times in samples.items():
            median = statistics.median(times)
            q = statistics.quantiles(times, n=10)
            print(f"{name:<6} median {median * 1e6:8.1f} us (p10-p90 {q[0] * 1e6:.0f}-"
                  f"{q[-1] * 1e6:.0f})   {name} / plain {median / plain:.2f}x")
        await _swap_times(executors, x)
    finally:
        for ex in executors.values():
            await ex.aclose()


async def _swap_times(executors: dict[str, asyncgraph.Executor], x: torch.Tensor) -> None:
    """What a weight swap costs each executor (compiled: the constant-buffer load into the
    spare container), median of 5 swaps, and that the results then agree."""
    from asyncgraph.testing.reference import perturbed_weights

    for seed in range(5):
        new = perturbed_weights(executors["plain"].weights.tensors, seed)
        for name, ex in executors.items():
            start = time.perf_counter()
            ex.swap_weights(new)
            _SWAPS.setdefault(name, []).append(time.perf_counter() - start)
        expected = await executors["plain"].execute(x)
        for ex in executors.values():
            torch.testing.assert_close(await ex.execute(x), expected, rtol=1e-4, atol=1e-4)
    for name, times in _SWAPS.items():
        print(f"{name:<6} swap_weights median {statistics.median(times) * 1e3:.2f} ms")


_SWAPS: dict[str, list[float]] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(run(args.rounds, args.calls, Path(workdir)))


if __name__ == "__main__":
    main()
