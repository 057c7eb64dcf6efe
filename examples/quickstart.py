"""Quickstart: export a model, run it from 100 concurrent callers (the README example)."""

import asyncio

import torch

import asyncgraph

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
batch = torch.export.Dim("batch", min=1, max=64)
ep = torch.export.export(model, (torch.randn(2, 16),), dynamic_shapes=({0: batch},))

async def main() -> None:
    config = asyncgraph.ExecutorConfig(max_parallel_ops=2, max_concurrent_executions=8)
    async with asyncgraph.Executor(ep, config) as ex:      # or asyncgraph.load("model.pt2")
        outs = await asyncio.gather(*(ex.execute(torch.randn(4, 16)) for _ in range(100)))
        print(len(outs), ex.statistics().frames)

asyncio.run(main())
