"""Compiled or plain: time a compiled package against the plain graph it was compiled from.

Why: compiled segments are not always faster. A model bound by memory bandwidth (the
benchmark MLP's batch-1 products stream 3 MB of weights per call) runs no faster in
AOTInductor's kernels, and a call into the compiled model costs more than the few Python
calls it replaces: that MLP's package took 165-179 us per execution against the plain
graph's 158 us (torch 2.11, one thread). `asyncgraph compile` reports this, measured on the
machine that compiled it, rather than leave the user to find it out in production.

Both run as asyncgraph Executors on the example inputs the package was compiled with (those
saved with the program, else random ones of its shapes), past adaptive placement's profiling
and first rechecks, then in alternate rounds with the order flipped each round; the verdict is
the median of the per-round ratios (choice.py judges kernels the same way), so drift in the
machine's speed cancels.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncgraph.compiled.choice import ROUNDS, calls_per_sample, judged, round_order

WARMUP = 40  # executions of each before timing: placement decides and rechecks within these
SAME_WITHIN = 0.03  # ratios within 1 +- this read "about the same"


@dataclass(frozen=True)
class PlainComparison:
    """The package's and the plain graph's time per execution on the example inputs."""

    compiled_ms: float
    plain_ms: float
    ratio: float  # median over rounds of compiled / plain

    @property
    def verdict(self) -> str:
        if self.ratio < 1 - SAME_WITHIN:
            return "faster"
        if self.ratio > 1 + SAME_WITHIN:
            return "slower"
        return "about the same"

    def describe(self) -> str:
        line = (f"compiled {self.compiled_ms:.3f} ms, plain graph {self.plain_ms:.3f} ms per "
                f"execution on the example inputs ({self.ratio:.2f}x): {self.verdict}")
        if self.verdict != "faster":
            line += "; the plain .pt2 runs this model as fast on this machine"
        return line


def compare_with_plain(package: str | Path, inputs: Sequence[Any] | None = None) -> PlainComparison:
    """Time the compiled `package` against its own program run plain, on `inputs` (flat user
    inputs; default: the example inputs). Runs on an event loop of its own, on a thread of
    its own, so it may be called from sync or async code."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(_run, Path(package), inputs).result()


def _run(package: Path, inputs: Sequence[Any] | None) -> PlainComparison:
    """The comparison's thread: its loop runs the inline kernels with the executors'
    intra-op count, as a service's loop thread is set (ExecutorConfig.intra_op_threads). Left
    at torch's default of 2 on this 2-core machine, once the main thread had used its OpenMP
    team this thread paid ~65 us per small product on its own team (4.5 us on the main
    thread), and the comparison measured the team, not the model."""
    from asyncgraph.runtime.config import ExecutorConfig

    before = torch.get_num_threads()
    torch.set_num_threads(ExecutorConfig().intra_op_threads_or_default)
    try:
        return asyncio.run(_compare(package, inputs))
    finally:
        torch.set_num_threads(before)


async def _compare(package: Path, inputs: Sequence[Any] | None) -> PlainComparison:
    import asyncgraph
    from asyncgraph.compiled.build import default_inputs
    from asyncgraph.compiled.package import load_source_program

    async with asyncgraph.load(package, trust_compiled=True) as compiled, \
            asyncgraph.Executor(load_source_program(package)) as plain:
        ep = plain.program.exported
        assert ep is not None
        flat = list(inputs) if inputs is not None else default_inputs(ep, plain.program.graph)
        executors = (compiled, plain)
        for executor in executors:
            for _ in range(WARMUP):
                await executor.execute_flat(flat)
        counts = [calls_per_sample(min([await _sample(executor, flat, 1) for _ in range(5)]))
                  for executor in executors]
        times: list[list[float]] = [[], []]
        for round_ in range(ROUNDS):
            for which in round_order(round_):
                times[which].append(await _sample(executors[which], flat, counts[which]))
    return PlainComparison(*judged(times))


async def _sample(executor: Any, flat: list[Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        await executor.execute_flat(flat)
    return (time.perf_counter() - start) / n
