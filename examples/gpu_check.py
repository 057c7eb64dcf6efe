"""GPU check: run the GPU tests, then time a multi-branch model on 1 stream vs several.

    python examples/gpu_check.py [--streams 4] [--iterations 50] [--concurrency 4]

Three timings of the same exported model, each on 1 stream and on `--streams` streams:

- the Executor (`ExecutorConfig(cuda=CudaConfig(streams=...))`): what a caller gets,
  scheduler included, with executions captured as CUDA graphs (the default; the capture
  decision is printed);
- the Executor with `CudaConfig(graphs=False)`: the stream path, node by node;
- the cuda layer alone (`asyncgraph.cuda.device.run_in_order`: the same begin / enqueue /
  host-wait / finish calls the scheduler makes, one node after another on the loop), which
  isolates what the streams buy from the scheduler's own overhead.

On a machine without CUDA it says so and exits 0: nothing was run or measured.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from asyncgraph.cuda.device import CudaRuntime, FrameStreams, run_in_order
from asyncgraph.cuda.streams import stream_plan_for
from asyncgraph.runtime.config import CudaConfig, ExecutorConfig
from asyncgraph.runtime.executor import Executor

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Branches(torch.nn.Module):
    """`width` independent MLP branches, summed: small kernels the GPU can overlap."""

    def __init__(self, width: int, depth: int, dim: int) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(depth)])
            for _ in range(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.relu(b(x)) for b in self.branches]).sum(0)


async def run_once(ex: Executor, state: FrameStreams, x: torch.Tensor) -> torch.Tensor:
    plan = ex.plan
    values = list(ex.weights.template(plan.weight_slots, plan.num_values))
    for slot in plan.token_slots:
        values[slot] = torch.empty(0)
    values[plan.user_input_slots[0]] = x
    with torch.inference_mode():
        await run_in_order(state, values)
    out: torch.Tensor = values[ex.graph.signature.user_outputs[0].arg.id]
    return out


async def time_layer(
    ep: Any, x: torch.Tensor, streams: int, iterations: int, concurrency: int
) -> tuple[float, float]:
    """(median latency of one execution in ms, executions/s with `concurrency` at once)."""
    ex = Executor(ep, ExecutorConfig())
    sp = stream_plan_for(
        ex.graph, ex.plan, streams, costs=[float(k.cost) for k in ex.kernels],
        default_device=torch.cuda.current_device(),
    )
    runtime = CudaRuntime(sp, ex.plan.outputs, max_stream_sets=concurrency)
    states = [runtime.frame_state(ex.plan.calls) for _ in range(concurrency)]
    for _ in range(5):
        await run_once(ex, states[0], x)
    latencies = []
    for _ in range(iterations):
        start = time.perf_counter()
        await run_once(ex, states[0], x)
        latencies.append(time.perf_counter() - start)

    async def worker(state: FrameStreams) -> None:
        for _ in range(iterations):
            await run_once(ex, state, x)

    start = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in states))
    throughput = concurrency * iterations / (time.perf_counter() - start)
    await ex.aclose()
    return statistics.median(latencies) * 1e3, throughput


async def time_executor(
    ep: Any, x: torch.Tensor, streams: int, iterations: int, concurrency: int,
    graphs: bool = True,
) -> tuple[float, float]:
    """The same two numbers as `time_layer`, through `Executor.execute`."""
    config = ExecutorConfig(
        cuda=CudaConfig(streams=streams, graphs=graphs), max_concurrent_executions=concurrency
    )
    async with Executor(ep, config) as ex:
        for _ in range(5):
            await ex.execute(x)
        latencies = []
        for _ in range(iterations):
            start = time.perf_counter()
            await ex.execute(x)
            latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        await asyncio.gather(*(ex.execute(x) for _ in range(concurrency * iterations)))
        throughput = concurrency * iterations / (time.perf_counter() - start)
        if graphs and streams == 1:
            plan, stats = ex.cuda_graph_plan, ex.cuda_graph_statistics()
            if plan is not None and stats is not None:
                print(f"CUDA graphs: {plan.describe()}; captures {stats.captures}, "
                      f"replays {stats.replays}, failures {list(stats.failed)}")
    return statistics.median(latencies) * 1e3, throughput


async def time_uncaptured(
    ep: Any, x: torch.Tensor, streams: int, iterations: int, concurrency: int
) -> tuple[float, float]:
    """`time_executor` with `CudaConfig(graphs=False)`."""
    return await time_executor(ep, x, streams, iterations, concurrency, graphs=False)


async def timing(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = Branches(args.width, args.depth, args.dim).cuda().eval()
    x = torch.randn(args.batch, args.dim, device="cuda")
    ep = torch.export.export(model, (x,))
    print(
        f"\nmodel: {args.width} branches x {args.depth} Linear({args.dim}) on "
        f"{torch.cuda.get_device_name()}, batch {args.batch}"
    )
    print(f"{'path':>20} {'streams':>8} {'latency ms':>11} {f'exec/s x{args.concurrency}':>14}")
    timers = (("Executor", time_executor), ("Executor, no graphs", time_uncaptured),
              ("cuda layer", time_layer))
    for name, timer in timers:
        results = {}
        for streams in sorted({1, args.streams}):
            latency, throughput = await timer(ep, x, streams, args.iterations, args.concurrency)
            results[streams] = latency
            print(f"{name:>20} {streams:>8} {latency:>11.3f} {throughput:>14.1f}")
        if args.streams != 1:
            ratio = results[1] / results[args.streams]
            print(f"{name}: latency on 1 stream / on {args.streams} streams: {ratio:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "No GPU available (torch.cuda.is_available() is False): the GPU tests and the "
            "stream timing were NOT run. Run this on a machine with a CUDA GPU."
        )
        return 0
    rc = 0
    if not args.skip_tests:
        rc = run_gpu_tests()
    asyncio.run(timing(args))
    return rc


def gpu_tests_command(*extra: str) -> list[str]:
    """pytest over the GPU test files (simulated and real-GPU tests), for a subprocess
    started in the repository root.

    In a subprocess, not `pytest.main` here: run as `python examples/gpu_check.py`, this
    process has examples/ as sys.path[0], so the tests' `tests` package (tests.support.loop_turns)
    would not import; `python -m pytest` in the root puts the root on sys.path, whatever
    directory this script was started from. pytest-benchmark is disabled: with xdist and
    `filterwarnings = error` it stops the session on the GPU image (docs/gpu.md).
    """
    return [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
        "--rootdir", str(ROOT), "tests/unit/test_stream_plan.py",
        "tests/integration/test_streams.py", "tests/integration/test_gpu_executor.py",
        "tests/integration/test_cuda_graphs.py",
        "-rs", *extra,
    ]


def run_gpu_tests(*extra: str) -> int:
    """Run the GPU tests (`gpu_tests_command`) in the repository root; their exit status."""
    return subprocess.run(gpu_tests_command(*extra), cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
