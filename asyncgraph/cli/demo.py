"""The demo: export a small bundled model, run it from many concurrent callers, check it.

Every output is compared with eager PyTorch; the table says nodes, latency, throughput and
whether everything matched.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import torch

from asyncgraph.cli.options import executor_config
from asyncgraph.runtime.executor import Executor


class DemoBlock(torch.nn.Module):
    """A small transformer encoder block: attention, layer norms and an MLP."""

    def __init__(self, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm1(x + a)
        out: torch.Tensor = self.norm2(x + self.mlp(x))
        return out


@dataclass(frozen=True)
class DemoResult:
    nodes: int
    executions: int
    concurrency: int
    p50_ms: float
    p99_ms: float
    throughput: float
    matched: int


async def run_demo(
    executions: int = 400, concurrency: int = 32, seed: int = 0, threads: int | None = None
) -> DemoResult:
    """Export DemoBlock, run `executions` calls from `concurrency` callers, compare with eager.

    `threads`: torch's intra-op threads (ExecutorConfig.intra_op_threads, applied to this
    thread as well; asyncgraph/cli/options.py).
    """
    config = executor_config(threads, max_concurrent_executions=8)
    torch.manual_seed(seed)
    model = DemoBlock().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    example = torch.randn(2, 16, 64)
    ep = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    inputs = [torch.randn(1 + i % 4, 16, 64) for i in range(executions)]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
    latencies: list[float] = []
    matched = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(executions):
        queue.put_nowait(i)

    async with Executor(ep, config) as ex:

        async def caller() -> None:
            nonlocal matched
            while not queue.empty():
                i = queue.get_nowait()
                start = time.perf_counter()
                out = await ex.execute(inputs[i])
                latencies.append(time.perf_counter() - start)
                torch.testing.assert_close(out, expected[i])
                matched += 1

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        nodes = ex.plan.num_nodes
    latencies.sort()
    return DemoResult(
        nodes=nodes,
        executions=executions,
        concurrency=concurrency,
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        throughput=executions / elapsed,
        matched=matched,
    )
