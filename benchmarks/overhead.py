"""Where asyncgraph's per-node and per-execution time goes (targets 1 and 2): a diagnostic.

    python -m benchmarks.overhead            # breakdown for the chain and the transformer
    python -m benchmarks.overhead --cprofile # plus cProfile's top functions
    python -m benchmarks.overhead --slice    # what the loop slice costs a ~1 ms execution
    python -m benchmarks.overhead --loop uvloop  # the breakdown on uvloop's loop

Unlike the suite, this reaches into the executor's internals (scheduler._complete, the pool,
frame.load), because the point is to price individual lines of the run loop; it will need
updating when they change. Every figure is the minimum over repetitions, in microseconds:
for pricing single lines the minimum is the cost without interference from the other
processes on the machine (timeit's advice), where the suite's medians describe a whole run.

Per node (chain of 1,000 relu, everything inline):
  kernel       `fn(x)` with the OpOverload's C++ callable: the floor (python loop peer)
  call         the plan's generated `n<i>(values)`, storing the result and dropping the
               previous one (as the scheduler's frees do): binding arguments
  complete     Scheduler._complete for one node: frees, counts, routing, under the lock
  lock         one `with frame.lock:` alone
  clock        one time.perf_counter() (the run loop reads it every node for the slice)
  execute      `await ex.execute(x)` divided by the nodes: everything
Per execution (a graph of one relu node), the steps `execute` takes, in order (its straight
line runs without a frame: Executor._run_alone):
  execute      `await ex.execute(x)`
  direct       the kernel alone; execute - direct is the fixed cost
  caller       the calling task and its pending cancellation (Executor._calling_task)
  flatten      the call's inputs, flat (InputValidator.flatten)
  check        validation, which also gives the inputs' signature (InputValidator.check)
  bind         the bound-loop check (Executor._bind_loop)
  choose       adaptive placement, found by the signature (AdaptivePlacement.choose)
  schedule     the placement's schedule (ScheduleCache.cached)
  free frame   whether a frame is free, so one may run without it (FramePool.has_free)
  mode         the execution's mode: the line fits what is left of the loop's slice
               (ModeChooser.choose)
  run          weights and inputs into the value slots and the straight line, kernel
               included (load_values, Scheduler.run_now)
  values       the outputs out, the slots cleared (the rest of Executor._run_alone)
  coroutines   creating and awaiting execute's two coroutines (execute, _execute), empty
  steps        the sum of the steps above, for comparison with execute
Loop slice (--slice; a 4-layer encoder, one caller awaiting executions back to back), per
execution, with its ratio to a 20 ms slice that holds many executions (never yields):
  <s> ms       `loop_slice_s` of s ms: an execution that does not fit what is left of the
               slice waits for the next iteration, and one longer than the slice runs over
               several; each Executor runs on an event loop of its own (the budget is per loop)
               and the loops alternate blocks of 10 executions
  20 ms + yield  the 20 ms slice with `await asyncio.sleep(0)` before each execution: what
               one loop iteration costs the execution after it
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.models import exported_chain, exported_encoder
from asyncgraph.runtime.backend import cancel_pending
from asyncgraph.runtime.frame import load_values


def median_us(fn: Callable[[], Any], repeat: int = 15, number: int = 200) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return min(samples) * 1e6


async def amedian_us(fn: Callable[[], Awaitable[Any]], repeat: int = 15, number: int = 20) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            await fn()
        samples.append((time.perf_counter() - start) / number)
    return min(samples) * 1e6


async def sliced_us(fn: Callable[[], Any], repeat: int = 30, number: int = 20) -> float:
    """median_us for steps that use the loop's slice: each repetition starts a new iteration
    (and so a new slice), which the straight line needs to run. `number` calls must fit in one
    slice (1 ms) even on a slow machine: 100 did not where a call took 20 us."""
    samples = []
    for _ in range(repeat):
        await asyncio.sleep(0)
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return min(samples) * 1e6


async def per_node(n: int = 1000) -> dict[str, float]:
    _, ep = exported_chain(n, (8, 64))
    x = torch.randn(8, 64)
    ex = Executor(ep, ExecutorConfig())
    try:
        await ex.execute(x)
        plan, sched = ex.plan, ex._scheduler
        frame = await ex._pool.acquire()
        fns = [k.fn for k in ex.kernels]
        calls, outputs = plan.calls, plan.outputs
        per_node = ex._schedules.get(plan.placement, fused=False)  # unit i is node i

        def kernels() -> None:
            y = x
            with torch.inference_mode():
                for fn in fns:
                    y = fn(y)

        def generated() -> None:
            frame.load(ex._weights_template(), [x], 0, per_node)
            values = frame.values
            with torch.inference_mode():
                prev = outputs[0] - 1  # the input
                for i in range(n):
                    out = outputs[i]
                    values[out] = calls[i](values)
                    values[prev] = None
                    prev = out

        def complete() -> None:
            frame.load(ex._weights_template(), [x], 0, per_node)
            frame.load_counters()
            stack: list[int] = []
            for i in range(n):
                sched._complete(frame, i, stack, False)
                stack.clear()

        def lock() -> None:
            lk = frame.lock
            for _ in range(n):
                with lk:
                    pass

        def clock() -> None:
            pc = time.perf_counter
            for _ in range(n):
                pc()

        result = {
            "kernel": median_us(kernels, number=5) / n,
            "call": median_us(generated, number=5) / n,
            "complete": median_us(complete, number=5) / n,
            "lock": median_us(lock, number=5) / n,
            "clock": median_us(clock, number=5) / n,
        }
        ex._pool.release(frame)
        result["execute"] = await amedian_us(lambda: ex.execute(x), number=5) / n
        return result
    finally:
        await ex.aclose()


async def per_execution() -> dict[str, float]:
    _, ep = exported_chain(1, (8, 64))
    x = torch.randn(8, 64)
    ex = Executor(ep, ExecutorConfig())
    try:
        for _ in range(10):  # past adaptive placement's profiling: the decided placement
            await ex.execute(x)
        fn = ex.kernels[0].fn
        flat = [x]
        signature = ex._validator.check(flat)
        adaptive = ex._adaptive
        assert adaptive is not None
        sched = ex._scheduler
        placement, times = adaptive.choose(None, sched.loaded, signature)
        assert times is None, "placement not decided yet"
        schedule = ex._schedules.cached(placement, True)
        assert schedule is not None
        pool = ex._pool
        modes = ex._modes
        assert schedule.straight is not None, "the one-node graph has no straight line"
        template = ex._weights_template()
        frame = ex._alone_frame

        frame.use(schedule)
        slots = ex.plan.user_input_slots

        def run() -> None:
            load_values(frame.values, template, slots, flat)
            sched.run_now(frame, time.perf_counter())

        async def nothing() -> None:
            pass

        async def two_coroutines() -> None:
            await nothing()

        execute = await amedian_us(lambda: ex.execute(x), number=200)
        r = {
            "execute": execute,
            "direct": median_us(lambda: fn(x)),
            "caller": median_us(lambda: cancel_pending(ex._calling_task())),
            "flatten": median_us(lambda: ex._validator.flatten((x,), {})),
            "check": median_us(lambda: ex._validator.check(flat)),
            "bind": median_us(ex._bind_loop),
            "choose": median_us(lambda: adaptive.choose(None, sched.loaded, signature)),
            "schedule": median_us(lambda: ex._schedules.cached(placement, True)),
            "free frame": median_us(pool.has_free),
            "mode": await sliced_us(lambda: modes.choose(schedule, None, True)),
            "run": median_us(run),
        }
        r["values"] = median_us(
            lambda: ex._run_alone(flat, schedule, time.perf_counter())) - r["run"]
        r["coroutines"] = await amedian_us(two_coroutines, number=200)
        r["steps"] = sum(v for k, v in r.items() if k not in {"execute", "direct"})
        return r
    finally:
        await ex.aclose()


async def profile(which: str, executions: int) -> str:
    if which == "chain":
        _, ep = exported_chain(1000, (8, 64))
        x = torch.randn(8, 64)
    else:
        _, ep = exported_encoder(128, 2, 16, False)
        x = torch.randn(1, 16, 128)
    ex = Executor(ep, ExecutorConfig(heavy_op_flops=2**62))  # inline: cProfile sees one thread
    try:
        for _ in range(10):
            await ex.execute(x)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(executions):
            await ex.execute(x)
        prof.disable()
    finally:
        await ex.aclose()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def slice_cost(rounds: int = 40) -> dict[str, float]:
    """Per-execution time (us) of the encoder under several loop slices, medians of rounds;
    and each one's median per-round ratio to the 20 ms slice."""
    _, ep = exported_encoder(128, 4, 16, False)
    x = torch.randn(1, 16, 128)
    setups = [("0.25 ms", 0.00025, False), ("1 ms (default)", 0.001, False),
              ("20 ms", 0.02, False), ("20 ms + yield", 0.02, True)]
    loops = {name: asyncio.new_event_loop() for name, _, _ in setups}
    executors = {name: Executor(ep, ExecutorConfig(loop_slice_s=s)) for name, s, _ in setups}

    async def block(ex: Executor, calls: int, yield_first: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            if yield_first:
                await asyncio.sleep(0)
            await ex.execute(x)
        return (time.perf_counter() - start) / calls

    samples: dict[str, list[float]] = {name: [] for name, _, _ in setups}
    try:
        for name, _, yield_first in setups:
            loops[name].run_until_complete(block(executors[name], 100, yield_first))
        for r in range(rounds):
            for name, _, yield_first in setups if r % 2 else setups[::-1]:
                samples[name].append(loops[name].run_until_complete(
                    block(executors[name], 10, yield_first)))
    finally:
        for name, loop in loops.items():
            loop.run_until_complete(executors[name].aclose())
            loop.close()
    base = samples["20 ms"]
    result = {}
    for name, v in samples.items():
        result[name] = statistics.median(v) * 1e6
        result[name + " ratio"] = statistics.median(a / b for a, b in zip(v, base, strict=True))
    return result


def _uvloop_run(coro: Coroutine[Any, Any, Any]) -> Any:
    import uvloop  # a dependency of asyncgraph's serving extra and of its tests

    return uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description="Price the lines of asyncgraph's run loop.")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--executions", type=int, default=200)
    parser.add_argument("--slice", action="store_true", help="only the loop slice's cost")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the event loop of the breakdown (uvloop: uvicorn's default)")
    args = parser.parse_args()
    run = asyncio.run if args.loop == "asyncio" else _uvloop_run
    torch.set_num_threads(1)
    if args.slice:
        print("per execution, 4-layer encoder, one caller (us; ratio to the 20 ms slice):")
        cost = slice_cost()
        for k in ("0.25 ms", "1 ms (default)", "20 ms", "20 ms + yield"):
            print(f"  {k:<16} {cost[k]:7.1f}  {cost[k + ' ratio']:.3f}")
        return
    node = run(per_node())
    print("per node, chain of 1,000 relu (us):")
    for k, v in node.items():
        print(f"  {k:<16} {v:7.3f}")
    execution = run(per_execution())
    print("per execution, one-node graph (us):")
    for k, v in execution.items():
        print(f"  {k:<16} {v:7.2f}")
    if args.cprofile:
        for which in ("chain", "transformer"):
            print(f"\ncProfile, {which}, {args.executions} executions, all inline:")
            print(run(profile(which, args.executions)))


if __name__ == "__main__":
    main()
