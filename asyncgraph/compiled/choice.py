"""Autotuned or default kernels: which compile of a segment to keep, by timing both here.

max-autotune (compile_program(autotune=True)) times candidate kernels one GEMM at a time, in
isolation, at compile time. The kernels it picks are not always faster as a whole segment:
on tiny BERT's 16-row GEMMs the autotuned segment ran slower than the default kernels in most
benchmark runs, and its choice moves with the machine's load. So an autotuned segment is kept
only when, run as a whole on the example inputs, it beats the same segment compiled with the
default kernels by KEEP_BELOW: the autotuned one costs a repack of its packed weights at every
swap (or cannot swap at all), which a tie does not pay for.

Both are timed alternately, round by round, with the order flipped each round, and judged by
the median of the per-round ratios, so drift in the machine's speed cancels.

A program with dynamic dimensions is timed twice: on the example inputs, and on inputs grown
along those dimensions to the largest size the program allows (build.py's `larger_inputs`).
The autotuned kernels are kept only when faster at both: on tiny BERT exported with a dynamic
batch up to 32, they were faster than the default's at the example's 2 rows and slower at 32,
the size a batching server runs
(benchmarks/results/cpu/design_measurements.md#autotuned-kernels-at-two-sizes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KEEP_BELOW = 0.97  # autotuned / default time at or above this keeps the default kernels
ROUNDS = 9
SAMPLE_S = 0.02  # about how long each timed sample lasts


@dataclass(frozen=True)
class KernelChoice:
    """The timing of one segment's two compiles and the one kept; `larger`, the same timing
    on inputs grown along the program's dynamic dimensions (`larger_label` says how)."""

    autotuned_ms: float
    default_ms: float
    ratio: float  # median over rounds of autotuned / default
    larger: KernelChoice | None = None
    larger_label: str = ""

    @property
    def keep_autotuned(self) -> bool:
        return self.ratio < KEEP_BELOW and (self.larger is None or self.larger.keep_autotuned)

    def describe(self) -> str:
        kept = "autotuned kernels kept" if self.keep_autotuned else "default kernels kept"
        larger = self.larger
        sizes = "" if larger is None else (
            f"; {self.larger_label}: {larger.autotuned_ms:.3f} ms autotuned, "
            f"{larger.default_ms:.3f} ms default (ratio {larger.ratio:.2f})")
        return (f"{kept}: {self.autotuned_ms:.3f} ms autotuned, {self.default_ms:.3f} ms "
                f"default (ratio {self.ratio:.2f}{sizes}; keeps autotuned below {KEEP_BELOW})")


def choose_kernels(
    autotuned: Path, default: Path, args: Sequence[Any], larger: Sequence[Any] | None = None,
    larger_label: str = "larger inputs",
) -> KernelChoice:
    """Time the AOTI packages `autotuned` and `default` of one segment on `args`, and on
    `larger` (the same inputs grown along their dynamic dimensions) when given."""
    example = _timed(autotuned, default, args)
    if larger is None:
        return KernelChoice(*example)
    return KernelChoice(*example, KernelChoice(*_timed(autotuned, default, larger)), larger_label)


def _timed(autotuned: Path, default: Path, args: Sequence[Any]) -> tuple[float, float, float]:
    calls = [_runner(autotuned, args), _runner(default, args)]
    counts = [calls_per_sample(min(_sample(call, 1) for _ in range(5))) for call in calls]
    times: list[list[float]] = [[], []]
    for round_ in range(ROUNDS):
        for which in round_order(round_):
            times[which].append(_sample(calls[which], counts[which]))
    return judged(times)


def calls_per_sample(fastest_s: float) -> int:
    """Calls that make a sample last about SAMPLE_S, from the fastest of a few warm-up calls
    (a compiled model's first calls are slower)."""
    return max(1, int(SAMPLE_S / max(fastest_s, 1e-6)))


def round_order(round_: int) -> tuple[int, int]:
    """Which of the two runs first in a round: flipped every round, so drift cancels."""
    return (0, 1) if round_ % 2 == 0 else (1, 0)


def judged(times: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """The median ms of each of the two and the median over rounds of first / second."""
    ratio = statistics.median(a / b for a, b in zip(times[0], times[1], strict=True))
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3, round(ratio, 3)


def _runner(path: Path, args: Sequence[Any]) -> Callable[[], Any]:
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    inputs = list(args)

    def run() -> Any:
        with torch.inference_mode():
            return loader.run(inputs)

    return run


def _sample(call: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n
