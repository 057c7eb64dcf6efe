"""Stress a small exported model: concurrent callers, cancellations, timeouts, injected
faults and weight swaps, every completed result checked against a serial reference.

    python examples/stress_run.py            # exits 1 on any violation
"""

from __future__ import annotations

import asyncio
import sys

import torch

from asyncgraph import ExecutorConfig
from asyncgraph.testing import StressConfig, run_stress


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


async def main() -> int:
    ep = torch.export.export(Block(), (torch.randn(4, 32),))
    config = StressConfig(
        executions=500, concurrency=32, cancel_rate=0.1, timeout_rate=0.05,
        fault_rate=0.05, swap_weights_every=50, seed=1,
    )
    report = await run_stress(ep, config, executor_config=ExecutorConfig(max_parallel_ops=2))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
