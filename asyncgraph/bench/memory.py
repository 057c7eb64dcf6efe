"""Target 5, memory: a 200-node chain whose intermediates are 4 MB each.

What is measured is the peak number (and bytes) of intermediates alive at once. Each node
calls `step`, which computes `x + 1` and registers the result with a tracker; a
weakref.finalize callback unregisters it the moment the last reference goes. That counts
exactly what the target is about, the values an executor keeps, whatever thread runs the node
and whatever allocator torch uses (a process's RSS cannot tell: glibc keeps freed blocks).

The graph is a torch.fx GraphModule calling `step`, so asyncgraph places every node on a worker
(a Python callable of unknown cost): serial is max_parallel_ops=1, parallel is 2. Peers show
what other executors keep: fx.Interpreter and fx's generated code free after last use, dask
releases as it goes, and a plain loop rebinds one variable.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.fx

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.harness import CaseResult, Context, Peer, PeerResult, Target, compare_outputs
from asyncgraph.bench.peers import (
    asyncgraph_peer,
    dask_peers,
    from_graph_module,
    fx_interpreter,
    left_out,
)

NAME = "memory"


class LiveTracker:
    """Counts the live tensors `step` made, and the peak, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live = self.live_bytes = self.peak = self.peak_bytes = 0

    def reset(self) -> tuple[int, int]:
        """Start a new peak; returns what is alive now, to subtract from it."""
        with self.lock:
            self.peak, self.peak_bytes = self.live, self.live_bytes
            return self.live, self.live_bytes

    def add(self, t: torch.Tensor) -> None:
        nbytes = t.untyped_storage().nbytes()
        with self.lock:
            self.live += 1
            self.live_bytes += nbytes
            self.peak = max(self.peak, self.live)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t, self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        with self.lock:
            self.live -= 1
            self.live_bytes -= nbytes


TRACKER = LiveTracker()


def step(x: torch.Tensor) -> torch.Tensor:
    """One node of the chain: a fresh 4 MB tensor, tracked until it dies."""
    y = x + 1
    TRACKER.add(y)
    return y


def chain_module(n: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for _ in range(n):
        value = graph.call_function(step, (value,))
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


async def run(ctx: Context) -> list[CaseResult]:
    s = ctx.settings
    n = s.pick(200, 200, 10)
    rows, cols = s.pick((1024, 1024), (1024, 1024), (16, 16))  # float32: 4 MB
    gm = chain_module(n)
    x = torch.randn(rows, cols)
    intermediate = x.untyped_storage().nbytes()
    serial = Executor(gm, ExecutorConfig(max_parallel_ops=1))
    parallel = Executor(gm, ExecutorConfig(max_parallel_ops=2))
    prog = from_graph_module(gm)
    interp = fx_interpreter(prog)

    def loop() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = step(y)
        return y

    def sync(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
        async def call() -> Any:
            return fn()
        return call

    peers = [
        asyncgraph_peer("asyncgraph (serial)", serial, [x], "max_parallel_ops=1"),
        asyncgraph_peer("asyncgraph (parallel)", parallel, [x], "max_parallel_ops=2"),
        Peer("python loop", sync(loop), "y = step(y), n times"),
        Peer("fx GraphModule", sync(lambda: gm(x)), "fx's generated code"),
        Peer("fx.Interpreter", sync(lambda: interp([x])), "torch.fx.Interpreter"),
        *dask_peers(prog, [x], workers=2),
    ]
    runs = s.pick(5, 3, 1)
    advance = ctx.task(f"{NAME}: {n} nodes x {intermediate >> 20} MB", len(peers))
    results: list[PeerResult] = []
    expected: Any = None
    try:
        for i, peer in enumerate(peers):
            result = PeerResult(peer.name, peer.note)
            peak = peak_bytes = 0
            times = []
            for _ in range(runs):
                live, live_bytes = TRACKER.reset()  # `expected` stays alive: not counted
                start = time.perf_counter()
                out = await peer.call()
                times.append(time.perf_counter() - start)
                peak = max(peak, TRACKER.peak - live)
                peak_bytes = max(peak_bytes, TRACKER.peak_bytes - live_bytes)
                if i == 0:
                    expected = out
                    result.matched = True
                elif result.matched is None:
                    try:
                        compare_outputs(expected, out)
                        result.matched = True
                    except AssertionError as exc:
                        result.matched = False
                        result.error = str(exc).splitlines()[0][:200]
                del out
            times.sort()
            result.median_s = times[len(times) // 2]
            result.samples = runs
            result.extra = {
                "peak_intermediates": peak,
                "peak_mb": peak_bytes / 2**20,
                "peak_in_intermediates": peak_bytes / intermediate,
            }
            results.append(result)
            advance()
    finally:
        await serial.aclose()
        await parallel.aclose()
    case = CaseResult(
        NAME, "memory", f"{n}-node chain, {intermediate / 2**20:.3g} MB intermediates",
        {"nodes": n, "intermediate_bytes": intermediate, "runs": runs}, results,
        columns="metrics", notes=left_out(),
    )
    for name in ("asyncgraph (serial)", "asyncgraph (parallel)"):
        case.targets.append(Target(
            5, f"peak live intermediates, {name.split('(')[1][:-1]}",
            case.peer(name).extra.get("peak_in_intermediates"), "<=", 3.0, unit="",
        ))
    return [case]
