"""How long the soak tests (marker `slow`, run with --run-slow) run.

ASYNCGRAPH_SOAK_SCALE multiplies every soak's size (executions, hypothesis examples): 1 (the
default) is the full soak of `make soak`; `make test` runs them at a small scale so CI
exercises every soak on every run. Read at import, since hypothesis sizes are decorator
arguments.
"""

from __future__ import annotations

import os

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
