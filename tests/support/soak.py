"""How long the soak tests (marker `slow`, run with --run-slow) run.

ASYNCGRAPH_SOAK_SCALE multiplies every soak's size (executions, hypothesis examples): 1 (the
default) is the full soak of `make soak`; `make test` runs them at a small scale so CI
exercises every soak on every run. Read at import, since hypothesis sizes are decorator
arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

SOAK_SCALE_VARIABLE = "ASYNCGRAPH_SOAK_SCALE"


def soak_scale() -> float:
    raw = os.environ.get(SOAK_SCALE_VARIABLE, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SOAK_SCALE_VARIABLE} must be a number, got {raw!r}") from None
    if not scale > 0:
        raise ValueError(f"{SOAK_SCALE_VARIABLE} must be > 0, got {raw!r}")
    return scale


def soak(full: int, minimum: int = 1) -> int:
    """`full` scaled by ASYNCGRAPH_SOAK_SCALE, and at least `minimum`."""
    return max(minimum, round(full * soak_scale()))


def full_soak_only(what: str) -> list[pytest.MarkDecorator]:
    """Marks for a test too long to scale down (`what` says why): a soak (`slow`) that runs
    in the full soak leg only (`make soak`, scale >= 1), and says so where it is skipped."""
    return [
        pytest.mark.slow,
        pytest.mark.skipif(
            soak_scale() < 1,
            reason=f"{what}: runs in the full soak leg only (make soak, ASYNCGRAPH_SOAK_SCALE>=1)",
        ),
    ]


def full_soak(what: str) -> Callable[[F], F]:
    """`full_soak_only`'s marks as a test function's decorator."""
    def apply(test: F) -> F:
        for mark in full_soak_only(what):
            test = mark(test)
        return test
    return apply
