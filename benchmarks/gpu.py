"""GPU benchmark: asyncgraph against eager, CUDA graphs and torch.compile, in one process.

    python -m benchmarks.gpu [--iterations 50] [--callers 64] [--quick]

Side by side, on random weights, each figure the median of `--iterations` timed calls after
warm-up, and every comparison a ratio of medians (peer / asyncgraph: above 1 means
asyncgraph is faster):

1. One caller, per model (a small transformer encoder, a CNN, a wide MLP): asyncgraph
   (`Executor.execute`, which returns once the GPU is done) with its executions captured as
   CUDA graphs (`CudaConfig(graphs=True)`, off by default: replays after warm-up; the capture
   decision is printed, with the reason when a model is not captured) and without them
   (`graphs=False`: the stream path) vs eager (`model(x)` then a stream synchronize) vs a
   CUDA-graph replay of eager (`torch.cuda.CUDAGraph`, input copied into the static buffer)
   vs `torch.compile(mode="reduce-overhead")` (its compile time printed).
2. `--callers` concurrent callers: asyncgraph (`asyncio.gather` of executes) vs eager on
   `asyncio.to_thread` (each call synchronizing its stream), as calls per second, and the
   event loop's lag p99 meanwhile (a 1 ms ticker's lateness).
3. The wide MLP on 1 vs 4 CUDA streams (`CudaConfig.streams`), captured and not.

Without CUDA it says it cannot run and exits 0: nothing was measured. docs/gpu.md says what
has and has not been run on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.runtime.config import CudaConfig


class Encoder(torch.nn.Module):
    """A small transformer encoder (4 layers, d_model 256, 4 heads)."""

    def __init__(self, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(
            dim, 4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(x)
        return out


class Cnn(torch.nn.Module):
    """Four conv-bn-relu blocks and a linear head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        blocks: list[torch.nn.Module] = []
        channels = 3
        for k in range(4):
            out = width * 2**k
            blocks += [
                torch.nn.Conv2d(channels, out, 3, stride=2, padding=1),
                torch.nn.BatchNorm2d(out), torch.nn.ReLU(),
            ]
            channels = out
        self.features = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x).mean((2, 3)))
        return out


class WideMlp(torch.nn.Module):
    """`width` independent MLP branches, summed: work several streams can overlap."""

    def __init__(self, width: int = 8, depth: int = 4, dim: int = 512) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(*[
                m for _ in range(depth) for m in (torch.nn.Linear(dim, dim), torch.nn.ReLU())
            ])
            for _ in range(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([b(x) for b in self.branches]).sum(0)


def models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "encoder": (Encoder(), torch.randn(8, 128, 256)),
        "cnn": (Cnn(), torch.randn(16, 3, 64, 64)),
        "wide-mlp": (WideMlp(), torch.randn(64, 512)),
    }


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


async def timed(call: Callable[[], Awaitable[Any]], iterations: int, warmup: int = 5) -> float:
    """Median milliseconds of `iterations` awaited calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return median_ms(samples)


def eager_call(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        with torch.inference_mode():
            out = model(x)
        torch.cuda.current_stream().synchronize()
        return out

    return call


def graph_call(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
    """A CUDA graph of eager: captured once after warm-up on a side stream (as torch's docs
    do); each call copies its input into the static input and replays."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        static_out = model(static_x)

    async def call() -> Any:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        return static_out

    return call


def compiled_call(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[Callable[[], Awaitable[Any]], float]:
    """torch.compile(mode="reduce-overhead") and its compile time (the first calls)."""
    compiled = torch.compile(model, mode="reduce-overhead")
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(3):  # cudagraph trees record on the later warm-up calls
            compiled(x)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start

    async def call() -> Any:
        with torch.inference_mode():
            out = compiled(x)
        torch.cuda.current_stream().synchronize()
        return out

    return call, compile_s


class LoopLag:
    """Lateness of a 1 ms ticker on the loop, while a block runs (p99 in ms)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - start - 0.001)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def p99_ms(self) -> float:
        if not self.lags:
            return float("nan")
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def graphs_line(ex: Executor) -> str:
    """The capture decision and what capture did (Executor.cuda_graph_statistics)."""
    plan, stats = ex.cuda_graph_plan, ex.cuda_graph_statistics()
    if plan is None or stats is None:
        return "no CUDA nodes"
    return (f"{plan.describe()}; captures {stats.captures}, replays {stats.replays}, "
            f"failures {stats.failures} {list(stats.failed)}")


async def one_caller(args: argparse.Namespace) -> None:
    print("\n1. one caller: median ms (ratio = peer / asyncgraph captured)")
    for name, (model, x_cpu) in models().items():
        model = model.cuda().eval()
        x = x_cpu.cuda()
        ep = torch.export.export(model, (x,))
        async with Executor(ep, ExecutorConfig(cuda=CudaConfig(streams=4, graphs=True))) as ex:
            ours = await timed(lambda ex=ex, x=x: ex.execute(x), args.iterations)
            captured = graphs_line(ex)
        uncaptured_config = ExecutorConfig(cuda=CudaConfig(streams=4, graphs=False))
        async with Executor(ep, uncaptured_config) as ex:
            uncaptured = await timed(lambda ex=ex, x=x: ex.execute(x), args.iterations)
        rows = [("asyncgraph, cuda.graphs=True", ours),
                ("asyncgraph, cuda.graphs=False", uncaptured),
                ("eager", await timed(eager_call(model, x), args.iterations))]
        rows.append(("cuda graph of eager", await timed(graph_call(model, x), args.iterations)))
        if not args.quick:
            call, compile_s = compiled_call(model, x)
            rows.append((f"torch.compile reduce-overhead (compile {compile_s:.1f} s)",
                         await timed(call, args.iterations)))
        print(f"  {name}: {captured}")
        for label, ms in rows:
            print(f"    {label:<48} {ms:8.3f} ms   x{ms / ours:5.2f}")


async def many_callers(args: argparse.Namespace) -> None:
    print(f"\n2. {args.callers} concurrent callers: calls/s and loop lag p99")
    for name, (model, x_cpu) in models().items():
        model = model.cuda().eval()
        x = x_cpu.cuda()
        ep = torch.export.export(model, (x,))
        config = ExecutorConfig(
            cuda=CudaConfig(streams=4, graphs=True), max_concurrent_executions=args.callers
        )
        async with Executor(ep, config) as ex:
            await asyncio.gather(*(ex.execute(x) for _ in range(args.callers)))  # warm-up
            async with LoopLag() as lag:
                start = time.perf_counter()
                for _ in range(args.rounds):
                    await asyncio.gather(*(ex.execute(x) for _ in range(args.callers)))
                ours = args.rounds * args.callers / (time.perf_counter() - start)
        ours_lag = lag.p99_ms()

        def eager_sync(model: torch.nn.Module = model, x: torch.Tensor = x) -> Any:
            with torch.inference_mode():
                out = model(x)
            torch.cuda.current_stream().synchronize()
            return out

        await asyncio.gather(*(asyncio.to_thread(eager_sync) for _ in range(args.callers)))
        async with LoopLag() as lag:
            start = time.perf_counter()
            for _ in range(args.rounds):
                await asyncio.gather(
                    *(asyncio.to_thread(eager_sync) for _ in range(args.callers))
                )
            theirs = args.rounds * args.callers / (time.perf_counter() - start)
        print(f"  {name}: asyncgraph {ours:9.1f}/s (lag p99 {ours_lag:6.2f} ms)   "
              f"to_thread(eager) {theirs:9.1f}/s (lag p99 {lag.p99_ms():6.2f} ms)   "
              f"ratio x{ours / theirs:5.2f}")


async def streams(args: argparse.Namespace) -> None:
    print("\n3. wide MLP, one caller: 1 vs 4 streams, captured and not")
    model, x_cpu = models()["wide-mlp"]
    model = model.cuda().eval()
    x = x_cpu.cuda()
    ep = torch.export.export(model, (x,))
    results = {}
    for graphs in (True, False):
        for count in (1, 4):
            config = ExecutorConfig(cuda=CudaConfig(streams=count, graphs=graphs))
            async with Executor(ep, config) as ex:
                results[graphs, count] = await timed(lambda ex=ex: ex.execute(x), args.iterations)
                line = graphs_line(ex)
            label = "captured" if graphs else "cuda.graphs=False"
            print(f"  {label:<18} {count} stream(s): {results[graphs, count]:8.3f} ms  ({line})")
    for graphs in (True, False):
        label = "captured" if graphs else "cuda.graphs=False"
        print(f"  {label}: 1 stream / 4 streams: "
              f"x{results[graphs, 1] / results[graphs, 4]:5.2f}")


async def run(args: argparse.Namespace) -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    await one_caller(args)
    await many_callers(args)
    await streams(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip torch.compile")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu cannot run: no CUDA GPU (torch.cuda.is_available() is False). "
              "Nothing was measured.")
        return 0
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
