"""How long the host's wait for a GPU event lasts past the event's completion (issue 36, item 1).

    python -m benchmarks.gpu_wait                      # simulated events; asyncio, uvloop, trio
    python -m benchmarks.gpu_wait --rounds 20 --waits 30
    python -m benchmarks.gpu_wait --cuda               # real events on a GPU (torch.cuda._sleep)
    python -m benchmarks.gpu_wait --cuda --executor    # and Executor.execute of an MLP

`asyncgraph.cuda.device.wait_events` under two policies, in alternating rounds of one run (each
round: every loop, in a rotated order; each loop: every GPU time; each GPU time: both policies,
in alternating order):

- old: `PollPolicy(thread=False)`, the wait before issue 36: a 100 us spin of zero-timeout
  checkpoints, then sleeps of elapsed/8 capped at 1 ms. asyncio's selector loop and trio
  round a timeout above zero up to 1 ms of epoll_wait; uvloop runs a timer under 1 ms on its
  next turn, so there the "sleeps" are zero-timeout polls (the loop spins).
- thread: `PollPolicy()` without a `WaitSite`: the same 100 us spin, then the process's
  waiter thread (asyncgraph/cuda/host_wait.py) blocks in `event.synchronize()` and wakes
  the loop.
- new: `PollPolicy()` with a `WaitSite` per loop and row (as the runtime keeps one per host
  node and one for an execution's end): waits measured to last up to 1 ms are polled to
  completion on the loop; longer ones go to the thread after 100 us, and the loop polls
  again from 1 ms before their expected end (a loop timer, up to 1 ms late on asyncio/trio).

Per loop, GPU time and policy: the median and p99 of the added latency (the time the wait
returned minus the time the event completed, in us), and how many waits went to the thread.
The row "300 us behind 2 ms" starts a 2 ms wait, then (10 us later) a 300 us one on another
stream, and times the second: it is queued behind the first on the waiter thread, so it shows
what head-of-line costs (the waiter's poll thread polls the queued wait's event meanwhile).

Simulated events (the default): an event completes at a given `time.perf_counter()`; `query()`
compares, `synchronize()` sleeps until then on its thread with a 1 ns timer slack
(PR_SET_TIMERSLACK), releasing the GIL as cudaEventSynchronize does. A real spinning
synchronize returns within a few us of completion; this sleep within ~5-60 us depending on
the kernel, so the new policy's figures here are if anything pessimistic.

With `--cuda`: the GPU work is `torch.cuda._sleep(cycles)` on a stream of its own (cycles
calibrated first), the event a `torch.cuda.Event` recorded after it. The completion time is not
observable from the host, so the reference is a third policy, `sync`: `event.synchronize()`
called on the loop thread (blocking the loop: what the wait must not do, and the fastest
possible return). Added latency there is each wait's time minus the median `sync` time of the
same loop and GPU time. Without CUDA, `--cuda` says so and exits 0.

With `--cuda --executor`, also end to end: `Executor.execute` of an exported MLP (8 x
Linear(1024) + relu on [1024, 1024], the stream path: its wait is the execution's `finish`)
with each policy set on its CudaRuntime, alternating per round, beside eager `model(x)` with a
stream synchronize.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from asyncgraph.cuda.device import PollPolicy, WaitSite, wait_events
from asyncgraph.cuda.host_wait import HostWaiter

POLICIES: dict[str, PollPolicy] = {
    "old": PollPolicy(thread=False), "thread": PollPolicy(), "new": PollPolicy(),
}
SITES: dict[tuple[str, str], WaitSite] = {}  # (loop, row): the "new" policy's measured sites
LOOPS = ("asyncio", "uvloop", "trio")
BEHIND_US = (300, 2000)  # the "300 us behind 2 ms" row: the timed wait, and the one ahead


# -- simulated events ---------------------------------------------------------------------------

_PR_SET_TIMERSLACK = 29
_slack_set = threading.local()


def _precise_timers() -> None:
    """A 1 ns timer slack for the calling thread (Linux; the default 50 us would add up to
    50 us to every sleep of the simulated synchronize)."""
    if getattr(_slack_set, "done", False):
        return
    _slack_set.done = True
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


class TimedEvent:
    """A simulated CUDA event that completes at `deadline` (time.perf_counter)."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def query(self) -> bool:
        return time.perf_counter() >= self.deadline

    def synchronize(self) -> None:
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            _precise_timers()
            time.sleep(remaining)  # releases the GIL, as cudaEventSynchronize does


class Simulated:
    """Events completing `us` after the wait starts; the completion time is known exactly."""

    name = "simulated"
    policies = ("old", "thread", "new")

    def start(self, us: float, stream: int = 0) -> tuple[TimedEvent, float]:
        event = TimedEvent(time.perf_counter() + us * 1e-6)
        return event, event.deadline

    def reference(self, samples: dict[str, list[float]]) -> float:
        return 0.0


# -- real events ----------------------------------------------------------------------------------


class Cuda:
    """`torch.cuda._sleep` on a stream of its own, then an event; completion not observable
    from the host: times are relative to the `sync` policy's median (`reference`)."""

    name = "cuda"
    policies = ("sync", "old", "thread", "new")

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.cycles_per_us = self._calibrate()

    def _calibrate(self) -> float:
        torch = self.torch
        stream = self.streams[0]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rates = []
        for _ in range(5):
            cycles = 2_000_000
            with torch.cuda.stream(stream):
                begin.record(stream)
                torch.cuda._sleep(cycles)
                end.record(stream)
            end.synchronize()
            rates.append(cycles / (begin.elapsed_time(end) * 1e3))
        return float(statistics.median(rates[1:]))

    def start(self, us: float, stream: int = 0) -> tuple[Any, float]:
        torch = self.torch
        s = self.streams[stream]
        event = torch.cuda.Event()
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(us * self.cycles_per_us))
        event.record(s)
        return event, time.perf_counter()  # the wait starts now; completion: see reference

    def reference(self, samples: dict[str, list[float]]) -> float:
        return float(statistics.median(samples["sync"]))

    def loop_turns_during_sync(self, ms: float = 20.0) -> int:
        """Loop turns (zero-timeout checkpoints of another task) while the waiter thread
        blocks in `synchronize()` on `ms` of GPU work: about none if it kept the GIL."""
        waiter = HostWaiter()
        count = 0

        async def body() -> None:
            nonlocal count
            done = False

            async def beat() -> None:
                nonlocal count
                while not done:
                    count += 1
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as group:
                group.start_soon(beat)
                await anyio.lowlevel.checkpoint()
                event, _ = self.start(ms * 1e3)
                start = count
                await wait_events([event], PollPolicy(spin_s=0.0), waiter)
                count -= start
                done = True

        asyncio.run(body())
        waiter.close()
        return count


# -- the measurement ---------------------------------------------------------------------------


async def _wait(policy: str, event: Any, waiter: HostWaiter, site: tuple[str, str]) -> None:
    if policy == "sync":
        event.query()
        event.synchronize()  # blocks the loop: the reference only
    else:
        measured = SITES.setdefault(site, WaitSite()) if policy == "new" else None
        await wait_events([event], POLICIES[policy], waiter, measured)


async def one_wait(
    gpu: Any, policy: str, us: float, waiter: HostWaiter, site: tuple[str, str]
) -> float:
    """Seconds from the event's completion (simulated) or the wait's start (cuda) to the
    wait's return."""
    event, completed = gpu.start(us)
    await _wait(policy, event, waiter, site)
    return time.perf_counter() - float(completed)


async def behind_wait(gpu: Any, policy: str, waiter: HostWaiter, loop: str) -> float:
    """The short wait of "300 us behind 2 ms": started 10 us after the long one."""
    short_us, long_us = BEHIND_US
    result: list[float] = []

    async def long_wait() -> None:
        event, _ = gpu.start(long_us, stream=1)
        await _wait(policy, event, waiter, (loop, "behind: long"))

    async def short_wait() -> None:
        t = time.perf_counter() + 10e-6
        while time.perf_counter() < t:
            await anyio.lowlevel.checkpoint()
        result.append(await one_wait(gpu, policy, short_us, waiter, (loop, "behind: short")))

    async with anyio.create_task_group() as group:
        group.start_soon(long_wait)
        group.start_soon(short_wait)
    return result[0]


Samples = dict[tuple[str, str, str], list[float]]  # (loop, row, policy) -> seconds


async def one_round(
    gpu: Any, loop: str, rows: Sequence[str], order: Sequence[str], waits: int,
    waiter: HostWaiter, samples: Samples, handed: dict[tuple[str, str, str], list[int]],
) -> None:
    for row in rows:
        for policy in order:
            before = waiter.handed
            for _ in range(waits):
                if row == "behind":
                    seconds = await behind_wait(gpu, policy, waiter, loop)
                else:
                    seconds = await one_wait(gpu, policy, float(row), waiter, (loop, row))
                samples.setdefault((loop, row, policy), []).append(seconds)
                await anyio.lowlevel.checkpoint()
            counts = handed.setdefault((loop, row, policy), [0, 0])
            counts[0] += waiter.handed - before
            counts[1] += waits * (2 if row == "behind" else 1)


def run_on(loop: str, body: Callable[[], Awaitable[None]]) -> None:
    if loop == "trio":
        import trio

        trio.run(body)
    elif loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(body())  # type: ignore[arg-type]
    else:
        asyncio.run(body())  # type: ignore[arg-type]


def available(loops: Sequence[str]) -> list[str]:
    out = []
    for loop in loops:
        module = {"asyncio": "asyncio", "uvloop": "uvloop", "trio": "trio"}[loop]
        try:
            __import__(module)
        except ImportError:
            print(f"({loop}: not installed, left out)")
            continue
        out.append(loop)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(gpu: Any, loops: Sequence[str], rows: Sequence[str], samples: Samples,
           handed: dict[tuple[str, str, str], list[int]]) -> None:
    print()
    print(f"{'loop':<8} {'GPU work':<18} {'policy':<6} {'n':>5} {'median us':>10} "
          f"{'p99 us':>9} {'to thread':>10}")
    for loop in loops:
        for row in rows:
            per_policy = {p: samples[(loop, row, p)] for p in gpu.policies}
            ref = gpu.reference(per_policy)
            label = "300 us behind 2 ms" if row == "behind" else f"{float(row):g} us"
            for policy in gpu.policies:
                added = [(s - ref) * 1e6 for s in per_policy[policy]]
                count, total = handed[(loop, row, policy)]
                share = f"{100 * count / total:.0f}%" if policy != "sync" else "-"
                extra = f"   (sync median {ref * 1e6:.1f} us from the wait's start)" if (
                    policy == "sync") else ""
                print(f"{loop:<8} {label:<18} {policy:<6} {len(added):>5} "
                      f"{statistics.median(added):>10.1f} {percentile(added, 0.99):>9.1f} "
                      f"{share:>10}{extra}")
        print()


# -- an Executor on a real GPU ------------------------------------------------------------------


def executor_rows(loops: Sequence[str], rounds: int, calls: int) -> None:
    """`Executor.execute` of an exported MLP on the GPU (the stream path): eager with a
    synchronize, and the Executor with each policy, alternating per round."""
    import torch

    from asyncgraph import Executor, ExecutorConfig

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda().eval()
    x = torch.randn(1024, 1024, device="cuda")
    with torch.no_grad():
        program = torch.export.export(model, (x,))
        expected = model(x)
    samples: dict[tuple[str, str], list[float]] = {}
    thread_only = PollPolicy(spin_max_s=0.0)  # no measured spin: 100 us, then the thread
    policies = {"old": POLICIES["old"], "thread": thread_only, "new": POLICIES["new"]}
    for r in range(-1, rounds):
        with torch.inference_mode():
            for _ in range(calls):
                t = time.perf_counter()
                model(x)
                torch.cuda.current_stream().synchronize()
                if r >= 0:
                    samples.setdefault(("eager", "sync"), []).append(time.perf_counter() - t)
        order = list(policies) if r % 2 == 0 else list(reversed(policies))
        for loop in loops:

            async def body(loop: str = loop, order: list[str] = order, r: int = r) -> None:
                ex = Executor(program, ExecutorConfig())
                try:
                    torch.testing.assert_close(await ex.execute(x), expected)
                    runtime = ex.cuda_runtime
                    if runtime is None:
                        raise RuntimeError("the model has no CUDA nodes")
                    for policy in order:
                        runtime.poll = policies[policy]
                        for _ in range(calls):
                            t = time.perf_counter()
                            await ex.execute(x)
                            if r >= 0:
                                samples.setdefault((loop, policy), []).append(
                                    time.perf_counter() - t)
                finally:
                    await ex.aclose()

            run_on(loop, body)
    print()
    print(f"Executor.execute, {len(layers) // 2} x Linear(1024) + relu on [1024, 1024], "
          f"stream path; {rounds} rounds x {calls} calls")
    print(f"{'loop':<8} {'policy':<7} {'median us':>10} {'p99 us':>9}")
    for (loop, policy), values in samples.items():
        us = [v * 1e6 for v in values]
        print(f"{loop:<8} {policy:<7} {statistics.median(us):>10.1f} {percentile(us, 0.99):>9.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--waits", type=int, default=20, help="waits per round, loop, row")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    parser.add_argument("--gpu-us", type=float, nargs="+", default=[50, 300, 2000],
                        help="GPU times after the wait starts, in us")
    parser.add_argument("--loop", action="append", choices=LOOPS,
                        help="loops to run (all three by default)")
    parser.add_argument("--no-behind", action="store_true",
                        help="leave out the 300 us behind 2 ms row")
    parser.add_argument("--cuda", action="store_true", help="real CUDA events (needs a GPU)")
    parser.add_argument("--executor", action="store_true",
                        help="with --cuda: also Executor.execute of an MLP, per policy")
    args = parser.parse_args(argv)
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.gpu_wait --cuda cannot run: no CUDA GPU "
                  "(torch.cuda.is_available() is False). Nothing was measured.")
            return 0
        gpu: Any = Cuda()
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{gpu.cycles_per_us:.0f} cycles/us")
        print(f"loop turns while the waiter thread synchronized 20 ms of GPU work: "
              f"{gpu.loop_turns_during_sync()} (about 0 would mean synchronize keeps the GIL)")
    else:
        gpu = Simulated()
    loops = available(args.loop or LOOPS)
    rows = [f"{us:g}" for us in args.gpu_us] + ([] if args.no_behind else ["behind"])
    print(f"events: {gpu.name}; Python {sys.version.split()[0]}; {args.rounds} rounds (after "
          f"{args.warmup} dropped) x {args.waits} waits per loop, row and policy")
    waiter = HostWaiter()  # the shared one's behaviour, counted for this run alone
    samples: Samples = {}
    handed: dict[tuple[str, str, str], list[int]] = {}
    for r in range(-args.warmup, args.rounds):  # rounds below 0: warm-up, dropped
        order = list(gpu.policies) if r % 2 == 0 else list(reversed(gpu.policies))
        kept: Samples = {} if r < 0 else samples
        counted: dict[tuple[str, str, str], list[int]] = {} if r < 0 else handed
        for i in range(len(loops)):
            loop = loops[(r + i) % len(loops)]

            async def body(
                loop: str = loop, order: list[str] = order, kept: Samples = kept,
                counted: dict[tuple[str, str, str], list[int]] = counted,
            ) -> None:
                await one_round(gpu, loop, rows, order, args.waits, waiter, kept, counted)

            run_on(loop, body)
    waiter.close()
    waiter.join(1.0)
    report(gpu, loops, rows, samples, handed)
    print(f"waiter (warm-up included): {waiter.handed} waits handed to the thread, "
          f"{waiter.resumed} polled again near their expected end, {waiter.taken_back} taken "
          f"back while queued, {waiter.started} thread start(s)")
    if args.cuda and args.executor:
        executor_rows(loops, max(2, args.rounds // 2), args.waits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
