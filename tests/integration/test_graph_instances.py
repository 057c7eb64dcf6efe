"""CUDA graph instances apart from frames (asyncgraph/cuda/instances.py, issue 50 item 1).

The Executor keeps, per input signature, a few captured graph instances; an execution in
Mode.CAPTURED leases one the way it leases a frame. Capture streams are leased per instance,
so 64 frames share the 8 instances that torch's 32 capture streams allow a plan on 4 streams,
instead of 8 frames capturing and 56 retrying (and paying for it) on every execution.

All on the simulated GPU of support/cuda_graph_fake.py, whose capture streams come round-robin
from 32 per device, as torch's do; each test ends with the leak check (`run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
from anyio.abc import TaskGroup

from asyncgraph import Executor, GraphBuilder
from asyncgraph.cuda import capture as cuda_capture
from asyncgraph.cuda import graphs
from asyncgraph.cuda import instances as cuda_instances
from asyncgraph.cuda.device import FrameStreams, PollPolicy
from asyncgraph.graph.importers import Program
from asyncgraph.graph.ir import Graph
from tests.support.backends import outcome_of, run, settle, until
from tests.support.cuda_graph_fake import (
    CaptureBackend,
    CaptureGpu,
    graph_instances,
    make_executor,
    running,
    stats,
    with_parameters,
)
from tests.support.fake_gpu import gpu_running

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _captures_wait_their_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent captures here queue for the process's capture lock as long as they need: on
    a loaded machine a wait past CAPTURE_WAIT_S (1 s) would run one uncaptured, and turn a
    test of instances into one of the lock's timeout (test_cuda_graphs.py tests that)."""
    monkeypatch.setattr(graphs, "CAPTURE_WAIT_S", 30.0)


def wide_graph() -> Graph:
    """x * w, then four branches (one per stream with `streams=4`), joined pairwise."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    scaled = b.call(aten.mul.Tensor, x, w, name="gpu_scale")
    branches = [
        b.call(op, scaled, name=f"gpu_{name}")
        for name, op in (("relu", aten.relu.default), ("sigmoid", aten.sigmoid.default),
                         ("tanh", aten.tanh.default), ("neg", aten.neg.default))
    ]
    left = b.call(aten.add.Tensor, branches[0], branches[1], name="gpu_left")
    right = b.call(aten.add.Tensor, branches[2], branches[3], name="gpu_right")
    b.output(b.call(aten.add.Tensor, left, right, name="gpu_join"))
    return b.build()


def wide_program(w: torch.Tensor) -> Program:
    return with_parameters(wide_graph(), {"w": w})


def wide_expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    scaled = x * w
    return (torch.relu(scaled) + torch.sigmoid(scaled)) + (torch.tanh(scaled) - scaled)


def inputs(k: int, n: int = 4) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n) * (k + 1)


def count_thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `anyio.to_thread.run_sync` from now on appends to the returned list (a capture's
    hop to a worker thread is one)."""
    hops: list[int] = []
    hop = anyio.to_thread.run_sync

    async def counted(*args: Any, **kwargs: Any) -> Any:
        hops.append(1)
        return await hop(*args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    return hops


def count_begins_and_finishes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """`FrameStreams.begin` and `finish` calls from now on: an execution's GPU bracket."""
    counts: Counter[str] = Counter()
    begin, finish = FrameStreams.begin, FrameStreams.finish

    def counted_begin(self: FrameStreams, only: Any = None) -> None:
        counts["begins"] += 1
        begin(self, only)

    async def counted_finish(self: FrameStreams, turn: bool = True) -> None:
        counts["finishes"] += 1
        await finish(self, turn)

    monkeypatch.setattr(FrameStreams, "begin", counted_begin)
    monkeypatch.setattr(FrameStreams, "finish", counted_finish)
    return counts


@contextlib.asynccontextmanager
async def paused(ex: Executor, gpu: CaptureGpu) -> AsyncIterator[TaskGroup]:
    """A task group for calls that start with the GPU paused. However the block ends, the GPU
    then runs until every frame is back: a failed assertion in the block cannot leave the
    calls waiting for a paused GPU (and the test hanging)."""
    async with anyio.create_task_group() as group:
        try:
            yield group
        finally:
            async with gpu_running(gpu):
                await until(lambda: ex.statistics().frames.in_use == 0, "every frame back")


async def paused_round(ex: Executor, gpu: CaptureGpu, calls: list[Callable[[], Any]]) -> None:
    """Start every call with the GPU paused, until each holds a frame (warming up, capturing,
    replaying or waiting for an instance); then run the GPU until every frame is back."""
    async with paused(ex, gpu) as group:
        for call in calls:
            group.start_soon(call)
        await until(lambda: ex.statistics().frames.in_use == len(calls), "every call's frame")


@contextlib.asynccontextmanager
async def closing(ex: Executor, gpu: CaptureGpu) -> AsyncIterator[Executor]:
    """The block with the GPU paused (rounds run it); the Executor closed with it running."""
    try:
        yield ex
    finally:
        async with gpu_running(gpu):
            await ex.aclose()


FRAMES = 64
ROUNDS = 4
CAPTURE_STREAMS = 32  # torch's high-priority pool per device (the fake's default)
PLAN_STREAMS = 4


@pytest.mark.timeout(90)
def test_64_frames_replay_or_wait_for_the_instances_capture_streams_allow(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 frames, 64 callers at once, a plan on 4 streams, 32 capture streams: after the
    signature's warm-up every execution captures an instance, or replays one (after waiting
    for it), and no execution after the first round asks for a capture stream or hops to a
    thread. Before, each frame leased its own capture streams: 8 frames captured, and the
    other 56, past their own warm-up, tried on every execution (begin, a thread hop, new
    static inputs and a copy) and fell back to the stream path."""
    # the per-signature bound out of the way: here the capture streams bound the instances
    monkeypatch.setattr(cuda_instances, "MAX_INSTANCES", FRAMES)
    hops = count_thread_hops(monkeypatch)

    async def body() -> None:
        gpu = CaptureGpu(seed=64)
        cuda = CaptureBackend(gpu, capture_streams_per_device=CAPTURE_STREAMS)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, cuda, graph_warmup=2, streams=PLAN_STREAMS,
                           max_concurrent_executions=FRAMES)
        assert ex.stream_plan is not None
        assert len(ex.stream_plan.streams_used) == PLAN_STREAMS
        held_before = cuda_capture.CAPTURE_STREAMS.held
        results: dict[int, torch.Tensor] = {}

        async def call(k: int) -> None:
            results[k] = await ex.execute(inputs(k))

        rounds: list[tuple[int, int, int, int, int, int]] = []
        try:
            for rnd in range(ROUNDS):  # the GPU paused while all enqueue: 64 frames in use
                before = stats(ex)
                requests, hopped = cuda.capture_stream_requests, len(hops)
                await paused_round(ex, gpu, [
                    functools.partial(call, k) for k in range(FRAMES * rnd, FRAMES * (rnd + 1))
                ])
                after = stats(ex)
                rounds.append((
                    after.warmups - before.warmups, after.captures - before.captures,
                    after.replays - before.replays, after.fallbacks - before.fallbacks,
                    cuda.capture_stream_requests - requests, len(hops) - hopped,
                ))
            # after warm-up (2 executions of the signature): captures and replays only, and
            # past the first round no lease attempt and no thread hop
            (warmups, captures, replays, fallbacks, _, _), *steady = rounds
            assert (warmups, fallbacks) == (2, 0), rounds
            assert captures + replays == FRAMES - 2, rounds
            assert steady == [(0, 0, FRAMES, 0, 0, 0)] * (ROUNDS - 1), rounds
            s = stats(ex)
            most = CAPTURE_STREAMS // PLAN_STREAMS
            assert s.captures == s.instances == most, s
            assert s.lease_failures == 1, s  # tried once, remembered until a release
            assert s.instance_waits >= FRAMES - 2 - most, s
            assert s.live_graphs == most
            assert len(set(cuda.captured_on)) == most  # no capture stream shared
            assert cuda_capture.CAPTURE_STREAMS.held == held_before + CAPTURE_STREAMS
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before  # every stream given back
        assert len(results) == FRAMES * ROUNDS
        for k, out in results.items():
            torch.testing.assert_close(out, wide_expected(inputs(k), w))
        assert gpu.errors == []

    run(body, backend)


# -- what a replay costs the host ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_replay_costs_the_host_one_bracket_one_query_and_no_thread(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted per replay: one begin and one finish (on the origin stream alone), no thread
    hop, no capture-stream request, no event made (a frame makes its events once). When the
    GPU is done by the time the host asks, the loop queries the end event once and
    synchronizes it (no poll, no hand-off); when it is not, and the wait goes to the waiter
    thread at once (`spin_s=0`), the loop queries once and hands it over once (no poll), and
    the waiter thread synchronizes it."""
    hops = count_thread_hops(monkeypatch)
    brackets = count_begins_and_finishes(monkeypatch)

    async def body() -> None:
        gpu = CaptureGpu(seed=12, eager=True)
        cuda = CaptureBackend(gpu)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, cuda, graph_warmup=1, streams=PLAN_STREAMS)
        runtime = ex.cuda_runtime
        assert runtime is not None

        def costs() -> dict[str, int]:
            return {
                "begins": brackets["begins"], "finishes": brackets["finishes"],
                "thread hops": len(hops), "lease requests": cuda.capture_stream_requests,
                "hand-offs": runtime.waiter.handed, **dataclasses.asdict(gpu.host),
            }

        def spent(before: dict[str, int]) -> dict[str, int]:
            return {name: count - before[name] for name, count in costs().items()}

        nothing = dict.fromkeys(costs(), 0)
        async with closing(ex, gpu):
            async with gpu_running(gpu):
                for k in range(2):  # warm-up, then the capture
                    await ex.execute(inputs(k))
                assert (stats(ex).captures, stats(ex).replays) == (1, 0)
                for k in range(2, 5):
                    before = costs()
                    out = await ex.execute(inputs(k))
                    torch.testing.assert_close(out, wide_expected(inputs(k), w))
                    assert spent(before) == {
                        **nothing, "begins": 1, "finishes": 1, "queries": 1,
                        "loop_queries": 1, "synchronizes": 1, "loop_synchronizes": 1,
                    }
            gpu.eager = False  # paused: the replay is still queued when the host asks
            runtime.poll = PollPolicy(spin_s=0.0)
            before = costs()
            outs: list[torch.Tensor] = []

            async def replay() -> None:
                outs.append(await ex.execute(inputs(5)))

            async with paused(ex, gpu) as group:
                group.start_soon(replay)
                await until(lambda: runtime.waiter.handed > before["hand-offs"], "handed")
            assert spent(before) == {
                **nothing, "begins": 1, "finishes": 1, "hand-offs": 1, "queries": 1,
                "loop_queries": 1, "synchronizes": 1,
            }
            torch.testing.assert_close(outs[0], wide_expected(inputs(5), w))
            assert stats(ex).replays == 4
        assert gpu.errors == []

    run(body, backend)


# -- cancellation and close ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_cancelled_wait_for_an_instance_leaves_no_waiter(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_instances, "MAX_INSTANCES", 1)  # one instance, two frames

    async def body() -> None:
        gpu = CaptureGpu(seed=13)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, graph_warmup=0, max_concurrent_executions=2)
        instances = graph_instances(ex)
        outs: dict[int, torch.Tensor] = {}
        cancelled: list[bool] = []
        async with closing(ex, gpu):
            async with gpu_running(gpu):
                outs[0] = await ex.execute(inputs(0))  # the capture of the one instance
            async with paused(ex, gpu) as group:
                scope = anyio.CancelScope()

                async def replaying() -> None:
                    outs[1] = await ex.execute(inputs(1))

                async def waiting() -> None:
                    with scope:
                        await ex.execute(inputs(2))
                    cancelled.append(scope.cancelled_caught)

                group.start_soon(replaying)
                await until(lambda: ex.statistics().frames.in_use == 1, "a replay in flight")
                group.start_soon(waiting)
                await until(lambda: instances.waiting == 1, "a waiter for the instance")
                scope.cancel()
                await until(lambda: bool(cancelled), "the waiter cancelled")
                assert instances.waiting == 0  # no entry left behind
            async with gpu_running(gpu):  # idle again: replayed at once, nobody waits
                outs[3] = await ex.execute(inputs(3))
        assert cancelled == [True]
        s = stats(ex)
        assert (s.captures, s.replays, s.instance_waits, s.fallbacks) == (1, 2, 1, 0), s
        assert ex.statistics().cancelled == 1
        for k, out in outs.items():
            torch.testing.assert_close(out, wide_expected(inputs(k), w))
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_cancelled_replay_gives_its_instance_back_only_once_its_gpu_work_is_done(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`finish` absorbs the cancellation until the replay's GPU work is done; only then does
    the instance go to the next waiter, whose input copy would otherwise overwrite static
    buffers that queued work still reads."""
    monkeypatch.setattr(cuda_instances, "MAX_INSTANCES", 1)

    async def body() -> None:
        gpu = CaptureGpu(seed=14, track_writers=True)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, graph_warmup=0, max_concurrent_executions=2)
        instances = graph_instances(ex)
        cancelled: list[bool] = []
        second: list[torch.Tensor] = []
        async with closing(ex, gpu):
            async with gpu_running(gpu):
                await ex.execute(inputs(0))  # captured
            async with paused(ex, gpu) as group:
                scope = anyio.CancelScope()

                async def first() -> None:
                    with scope:
                        await ex.execute(inputs(1))
                    cancelled.append(scope.cancelled_caught)

                async def later() -> None:
                    second.append(await ex.execute(inputs(2)))

                group.start_soon(first)
                await until(lambda: ex.statistics().frames.in_use == 1, "replay enqueued")
                await settle()
                assert any(op[0] == "kernel" and op[1][0] == "replay"
                           for s in gpu.streams for op in s.queue)
                scope.cancel()
                await settle()
                assert not cancelled  # finish() absorbs it until the GPU is done
                group.start_soon(later)
                await until(lambda: instances.waiting == 1, "the later execution waits")
                await settle()
                assert instances.waiting == 1 and not second  # the instance is not handed on
        assert cancelled == [True]
        torch.testing.assert_close(second[0], wide_expected(inputs(2), w))
        s = stats(ex)
        assert (s.replays, s.instance_waits, s.instances) == (2, 1, 0), s  # 0: closed
        assert ex.statistics().cancelled == 1
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_replay_gives_its_instance_back_before_it_waits_for_room_in_the_loops_slice(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its GPU work is done, an execution may wait for room in the loop's slice before
    it goes on (`FrameStreams.take_turn`). Its graph instance is back by then: an execution
    queued for it replays meanwhile, instead of waiting for the other's turn too."""
    events: list[str] = []
    take_turn, give_back = FrameStreams.take_turn, cuda_instances.GraphInstances.give_back

    async def observed_turn(self: FrameStreams) -> None:
        if self._budget is not None:  # once per execution: the budget `begin` charged
            events.append("turn")
        await take_turn(self)

    def observed_give_back(self: Any, instance: Any) -> None:
        events.append("back")
        give_back(self, instance)

    monkeypatch.setattr(FrameStreams, "take_turn", observed_turn)
    monkeypatch.setattr(cuda_instances.GraphInstances, "give_back", observed_give_back)

    async def body() -> None:
        gpu = CaptureGpu(seed=15)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, graph_warmup=0)
        async with closing(ex, gpu), gpu_running(gpu):
            await ex.execute(inputs(0))  # captured: its turn comes inside the capture
            events.clear()
            for k in range(1, 4):
                torch.testing.assert_close(await ex.execute(inputs(k)), wide_expected(inputs(k), w))
        assert events == ["back", "turn"] * 3, events
        assert stats(ex).replays == 3

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_burst_of_callers_starts_a_slice_of_executions_per_loop_iteration(backend: str) -> None:
    """64 callers arrive in one loop iteration. Each execution's fixed host work (`begin`, a
    replay's launch and copies, its return) takes the loop's slice (`LoopCharges.admit`), so
    an iteration replays only the executions that fit in it; timers and I/O get their turn in
    between. Before, all 64 replayed in the first iteration (the simulated GPU here is done
    at once). The graphs are captured ahead (`warm_up`), so no execution runs the stream path
    and the scheduler never asks for the loop's budget: the slice is the GPU path's own
    `loop_slice_s`, not an endless one."""
    slice_s = 5e-4  # the fake's replay costs the host 50-90 us: a few fit in a slice

    async def body() -> None:
        gpu = CaptureGpu(seed=21, eager=True)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, graph_warmup=0, loop_slice_s=slice_s,
                           max_concurrent_executions=FRAMES)
        results: dict[int, torch.Tensor] = {}
        replays: list[int] = []  # replays launched, after each loop iteration

        async def call(k: int) -> None:
            results[k] = await ex.execute(inputs(k))

        async def probe() -> None:  # started after the callers: sees each iteration's end
            while len(results) < FRAMES:
                replays.append(stats(ex).replays)
                await anyio.lowlevel.checkpoint()

        async with closing(ex, gpu), gpu_running(gpu):
            await ex.warm_up(inputs(0))
            before = stats(ex)
            async with anyio.create_task_group() as group:
                for k in range(FRAMES):
                    group.start_soon(call, k)
                group.start_soon(probe)
            after = stats(ex)
        per_iteration = [b - a for a, b in itertools.pairwise([before.replays, *replays])]
        assert max(per_iteration) <= FRAMES // 4, per_iteration
        deferred = after.loop_turns_deferred - before.loop_turns_deferred
        assert FRAMES // 2 <= deferred <= 2 * FRAMES, after  # to start, and to go on: no more
        assert (after.replays - before.replays, after.fallbacks, after.before_ready) == (
            FRAMES, 0, 0), after
        for k, out in results.items():
            torch.testing.assert_close(out, wide_expected(inputs(k), w))
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel", [False, True])
def test_closing_ends_executions_waiting_for_room_in_the_loops_slice(
    backend: str, cancel: bool,
) -> None:
    """`aclose()` while executions of a burst wait for room in the loop's slice
    (`LoopCharges.admit`, holding their frames): they are in flight, so each gets its output;
    with `cancel=True` each ends with its output or as closed or cancelled. Nothing waits on."""

    async def body() -> None:
        gpu = CaptureGpu(seed=22, eager=True)
        w = torch.full((4,), 0.5)
        ex = make_executor(wide_program(w), gpu, graph_warmup=0, loop_slice_s=5e-4,
                           max_concurrent_executions=FRAMES)
        charges = ex.cuda_runtime.charges  # type: ignore[union-attr]
        outcomes: dict[str, str] = {}
        async with gpu_running(gpu):
            await ex.warm_up(inputs(0))
            async with anyio.create_task_group() as group:
                for k in range(FRAMES):
                    group.start_soon(outcome_of, ex.execute(inputs(k)), outcomes, str(k))
                # every execution past `execute`'s check and holding its frame, most waiting
                # for room: on trio, once Hypothesis is imported, its batches run shuffled,
                # and this task can look between the executions of one batch
                await until(lambda: ex.statistics().started == FRAMES
                            and charges.statistics().waiting > FRAMES // 2, "a queue", poll_s=0)
                await ex.aclose(cancel=cancel)
        assert len(outcomes) == FRAMES
        if cancel:
            assert set(outcomes.values()) <= {"value", "closed", "cancelled"}, outcomes
            assert set(outcomes.values()) != {"value"}, outcomes
        else:
            assert set(outcomes.values()) == {"value"}, outcomes
        assert charges.statistics().waiting == 0
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_closing_frees_every_instance_and_releases_every_capture_stream(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=15)
        cuda = CaptureBackend(gpu)
        w4, w8 = torch.full((4,), 0.5), torch.full((8,), 0.5)
        ex = make_executor(wide_graph(), gpu, cuda, graph_warmup=0, streams=PLAN_STREAMS,
                           max_concurrent_executions=4)
        instances = graph_instances(ex)
        held_before = cuda_capture.CAPTURE_STREAMS.held

        async def call(n: int, w: torch.Tensor, k: int) -> None:
            torch.testing.assert_close(await ex.execute(inputs(k, n), w),
                                       wide_expected(inputs(k, n), w))

        async with closing(ex, gpu):
            for rnd in range(2):  # a first instance per signature, then a second beside it
                await paused_round(ex, gpu, [
                    functools.partial(call, n, w, 2 * rnd + i)
                    for n, w in ((4, w4), (8, w8)) for i in range(2)
                ])
            assert stats(ex).instances == 4
            assert cuda_capture.CAPTURE_STREAMS.held == held_before + 4 * PLAN_STREAMS
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert list(instances) == [] and stats(ex).live_graphs == 0
        assert len(cuda.graphs) == 4 and all(g.freed for g in cuda.graphs)
        assert gpu.errors == []

    run(body, backend)


# -- weights, failures, leases, eviction ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_weights_swap_recaptures_each_instance_and_never_replays_old_weights(
    backend: str,
) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=16, track_writers=True)
        cuda = CaptureBackend(gpu)
        old, new = torch.full((4,), 0.5), torch.tensor([-1.0, 0.0, 1.0, 4.0])
        ex = make_executor(wide_program(old), gpu, cuda, graph_warmup=0,
                           max_concurrent_executions=2)
        instances = graph_instances(ex)
        outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        async def call(k: int, w: torch.Tensor) -> None:
            outs[k] = (await ex.execute(inputs(k)), w)

        async with closing(ex, gpu):
            for rnd in range(2):  # two instances for the old weights
                await paused_round(ex, gpu, [functools.partial(call, 2 * rnd + i, old)
                                             for i in range(2)])
            assert (stats(ex).captures, stats(ex).instances) == (2, 2)
            old_graphs = list(cuda.graphs)
            old_replays = [g.replays for g in old_graphs]
            ex.swap_weights({"w": new})
            for rnd in range(2, 4):  # both recaptured at once, then replayed
                await paused_round(ex, gpu, [functools.partial(call, 2 * rnd + i, new)
                                             for i in range(2)])
            s = stats(ex)
            assert (s.captures, s.recaptures, s.instances, s.fallbacks) == (4, 2, 2, 0), s
            assert [g.replays for g in old_graphs] == old_replays  # never replayed again
            assert all(g.freed for g in old_graphs)
            assert {i.version for i in instances} == {ex.statistics().weights_version}
        for k, (out, w) in outs.items():
            torch.testing.assert_close(out, wide_expected(inputs(k), w))
        assert gpu.errors == []

    run(body, backend)


def syncing_graph() -> Graph:
    b = GraphBuilder()
    y = b.call(aten.relu.default, b.input("x"), name="gpu_relu")
    b.output(b.call(aten.clone.default, y, name="gpu_sync_check"))  # reads a GPU value inside
    return b.build()


@pytest.mark.timeout(60)
def test_a_capture_that_fails_is_tried_once_and_its_waiters_take_the_stream_path(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature's first instance is captured alone: the executions arriving meanwhile wait
    for it, and when its capture raises they take the stream path (one attempt, one thread
    hop, one graph), and every capture stream goes back."""
    hops = count_thread_hops(monkeypatch)

    async def body() -> None:
        gpu = CaptureGpu(seed=17)
        cuda = CaptureBackend(gpu)
        ex = make_executor(syncing_graph(), gpu, cuda, graph_warmup=0,
                           max_concurrent_executions=4)
        instances = graph_instances(ex)
        held_before = cuda_capture.CAPTURE_STREAMS.held

        async def call(k: int) -> None:
            torch.testing.assert_close(await ex.execute(inputs(k)), torch.relu(inputs(k)))

        async with closing(ex, gpu):
            async with paused(ex, gpu) as group:
                with cuda_capture.CAPTURE_LOCK:  # the capture waits until the others wait too
                    for k in range(4):
                        group.start_soon(call, k)
                    await until(lambda: instances.waiting == 3, "three waiters")
            assert ex.statistics().completed == 4
        s = stats(ex)
        assert (s.captures, s.failures, s.fallbacks, s.instance_waits) == (0, 1, 3, 3), s
        assert len(cuda.graphs) == 1 and len(hops) == 1
        assert cuda_capture.CAPTURE_STREAMS.held == held_before and list(instances) == []
        assert gpu.errors == []

    run(body, backend)


class RefusingBackend(CaptureBackend):
    """Captures that raise at their start while `refuse` is set (out of memory, say)."""

    refuse = False

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, handle: Any) -> Iterator[None]:
        with super().capture(graph, pool, handle):
            if self.refuse:
                raise RuntimeError("out of memory while capturing")
            yield


@pytest.mark.timeout(60)
def test_a_signature_whose_recapture_fails_frees_its_other_instances(backend: str) -> None:
    """After a weights swap the first recapture raises: the signature is uncapturable, and its
    other instance, idle and no longer leased by anyone, is freed with its capture streams
    (they would be held until the Executor closes)."""
    async def body() -> None:
        gpu = CaptureGpu(seed=21)
        cuda = RefusingBackend(gpu)
        old, new = torch.full((4,), 0.5), torch.full((4,), -2.0)
        ex = make_executor(wide_program(old), gpu, cuda, graph_warmup=0, streams=PLAN_STREAMS,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held

        async def call(k: int) -> None:
            torch.testing.assert_close(await ex.execute(inputs(k)), wide_expected(inputs(k), old))

        async with closing(ex, gpu):
            for rnd in range(2):
                await paused_round(ex, gpu, [functools.partial(call, 2 * rnd + i)
                                             for i in range(2)])
            assert stats(ex).instances == 2
            ex.swap_weights({"w": new})
            cuda.refuse = True
            async with gpu_running(gpu):
                for k in range(2):  # the recapture fails (run uncaptured), then the stream path
                    out = await ex.execute(inputs(k))
                    torch.testing.assert_close(out, wide_expected(inputs(k), new))
            s = stats(ex)
            assert (s.failures, s.recaptures, s.instances, s.fallbacks) == (1, 1, 0, 1), s
            assert cuda_capture.CAPTURE_STREAMS.held == held_before
            assert list(graph_instances(ex)) == []
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_failed_lease_is_remembered_until_another_holder_releases_capture_streams(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executor `a` holds every capture stream: `b` asks the pool once, then takes the stream
    path with no request and no thread hop, until `a` closes; then `b` captures."""
    hops = count_thread_hops(monkeypatch)

    async def body() -> None:
        gpu = CaptureGpu(seed=18)
        cuda = CaptureBackend(gpu, capture_streams_per_device=PLAN_STREAMS)
        w = torch.full((4,), 0.5)
        a, b = (make_executor(wide_program(w), gpu, cuda, graph_warmup=0,
                              streams=PLAN_STREAMS) for _ in range(2))
        async with closing(b, gpu), gpu_running(gpu):
            await a.execute(inputs(0))
            assert stats(a).instances == 1
            seen = []
            for k in range(3):
                requests, hopped = cuda.capture_stream_requests, len(hops)
                torch.testing.assert_close(await b.execute(inputs(k)), wide_expected(inputs(k), w))
                seen.append((cuda.capture_stream_requests - requests, len(hops) - hopped))
            full_round = cuda_instances.CaptureStreamLeases.TRIES
            assert seen == [(full_round, 0), (0, 0), (0, 0)]
            s = stats(b)
            assert (s.captures, s.fallbacks, s.lease_failures) == (0, 3, 1), s
            await a.aclose()  # its capture streams go back
            torch.testing.assert_close(await b.execute(inputs(3)), wide_expected(inputs(3), w))
            assert (stats(b).captures, stats(b).instances) == (1, 1)
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_evicting_a_signature_frees_its_instances_and_their_capture_streams(backend: str) -> None:
    """8 signatures of a plan on 4 streams hold all 32 capture streams; a ninth evicts the
    least recently used, whose instance's streams it then leases."""
    async def body() -> None:
        gpu = CaptureGpu(seed=19)
        cuda = CaptureBackend(gpu)
        ex = make_executor(wide_program(torch.tensor(0.5)), gpu, cuda, graph_warmup=0,
                           streams=PLAN_STREAMS,
                           max_captured_signatures=cuda_capture.MAX_CAPTURES)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        async with running(ex, gpu):
            for n in range(1, cuda_capture.MAX_CAPTURES + 2):
                out = await ex.execute(inputs(0, n))
                torch.testing.assert_close(out, wide_expected(inputs(0, n), torch.tensor(0.5)))
            s = stats(ex)
            assert (s.captures, s.evictions, s.instances, s.lease_failures) == (9, 1, 8, 0), s
            assert cuda_capture.CAPTURE_STREAMS.held == held_before + CAPTURE_STREAMS
            assert cuda.graphs[0].freed and not any(g.freed for g in cuda.graphs[1:])
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_signature_without_instances_takes_the_streams_of_another_ones_idle_second(
    backend: str,
) -> None:
    """Capture streams for two instances: signature 4 has both; signature 8, which has none,
    frees one of 4's idle ones for its own instead of never capturing."""
    async def body() -> None:
        gpu = CaptureGpu(seed=20)
        cuda = CaptureBackend(gpu, capture_streams_per_device=2)
        w4, w8 = torch.full((4,), 0.5), torch.full((8,), 0.5)
        ex = make_executor(wide_graph(), gpu, cuda, graph_warmup=0, streams=1,
                           max_concurrent_executions=2)

        async def call(n: int, w: torch.Tensor, k: int) -> None:
            torch.testing.assert_close(await ex.execute(inputs(k, n), w),
                                       wide_expected(inputs(k, n), w))

        async with closing(ex, gpu):
            for rnd in range(2):
                await paused_round(ex, gpu, [functools.partial(call, 4, w4, 2 * rnd + i)
                                             for i in range(2)])
            assert stats(ex).instances == 2
            async with gpu_running(gpu):
                for k in range(3):
                    await call(8, w8, k)
                    await call(4, w4, k)
            s = stats(ex)
            assert (s.captures, s.instances, s.evictions, s.fallbacks) == (3, 2, 1, 0), s
            assert s.lease_failures == 1, s
        assert gpu.errors == []

    run(body, backend)


def test_a_lease_that_fails_while_a_holder_releases_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed lease is remembered by the generation it failed at: the one read before the
    attempt, not after it, or a release by another thread in between (a frame's segments
    capture on workers; a collected holder's finalizer runs anywhere) would be taken for one
    already tried, and the holder would wait for a further release that may never come."""
    gpu = CaptureGpu(seed=22)
    cuda = CaptureBackend(gpu, capture_streams_per_device=1)
    keys = [(0, 0)]
    holder, late = cuda_capture.FrameLease(), cuda_capture.FrameLease()
    assert holder.get(cuda, keys) is not None  # the only capture stream
    leases = cuda_capture.CAPTURE_STREAMS
    attempt = leases.lease

    def released_meanwhile(backend: Any, wanted: Any) -> Any:
        taken = attempt(backend, wanted)
        leases.release([])  # another holder gave streams back while this one found none
        return taken

    monkeypatch.setattr(leases, "lease", released_meanwhile)
    try:
        assert late.get(cuda, keys) is None
        monkeypatch.undo()
        requests = cuda.capture_stream_requests
        assert late.get(cuda, keys) is None  # still none free, but asked again
        assert cuda.capture_stream_requests > requests
        requests = cuda.capture_stream_requests
        assert late.get(cuda, keys) is None  # and now remembered: no release since
        assert cuda.capture_stream_requests == requests
    finally:
        holder.release()
