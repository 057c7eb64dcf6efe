"""The admission policy (asyncgraph/serve/admission.py) on a fake clock: no executor, no server.

The gate admits by expected wait against the request's deadline and refuses at its memory caps;
the app-level tests (a burst at default settings, sustained overload, the caps through HTTP)
are in test_serve.py.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from asyncgraph.serve.admission import (
    DEADLINE,
    MAX_QUEUE,
    MAX_QUEUE_BYTES,
    SERVICE_EWMA_WEIGHT,
    THROUGHPUT_EWMA_WEIGHT,
    Admission,
    Ticket,
)
from asyncgraph.serve.errors import ProtocolError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(capacity: int = 1, max_queue: int = 1000, max_queue_bytes: int = 1 << 30) -> Admission:
    return Admission("m", capacity, max_queue, max_queue_bytes, clock=FakeClock())


def clock_of(admission: Admission) -> FakeClock:
    clock = admission.clock
    assert isinstance(clock, FakeClock)
    return clock


async def measure(admission: Admission, *service_s: float) -> None:
    """Run requests one after another that each hold a slot for `service_s` fake seconds."""
    for seconds in service_s:
        with admission.enter() as ticket:
            async with admission.slot(ticket):
                clock_of(admission).now += seconds


def refused(reason: str, admission: Admission, *args: float | None) -> ProtocolError:
    before = admission.refused[reason]
    with pytest.raises(ProtocolError) as info:
        admission.enter(*args)  # type: ignore[arg-type]
    assert info.value.status == 503
    assert admission.refused[reason] == before + 1
    return info.value


async def test_service_time_is_an_exponentially_weighted_mean() -> None:
    admission = gate(capacity=4)
    assert admission.mean_service_s is None and admission.service_rate is None
    await measure(admission, 0.2)
    assert admission.mean_service_s == pytest.approx(0.2)
    assert admission.service_rate == pytest.approx(4 / 0.2)  # capacity / mean service
    await measure(admission, 1.2)
    assert admission.mean_service_s == pytest.approx(0.2 + SERVICE_EWMA_WEIGHT * 1.0)
    stats = admission.statistics()
    assert stats.completed == stats.admitted == 2 and stats.queued == stats.running == 0


async def test_the_backlogged_throughput_counts_the_time_outside_the_slot_too() -> None:
    """A request's body read and decode happen before its slot; when they are the bottleneck
    the slot time says the gate is fast while completions say otherwise. The rate follows
    completions per backlogged second once the gate has been backlogged."""
    admission = gate(capacity=1)
    clock = clock_of(admission)
    a, b, c = admission.enter(), admission.enter(), admission.enter()  # backlogged from here
    async with admission.slot(a):
        clock.now += 0.5
    assert admission.throughput == pytest.approx(1 / 0.5)
    clock.now += 1.0  # b's decode, outside any slot
    async with admission.slot(b):
        clock.now += 0.5
    keep = 1 - THROUGHPUT_EWMA_WEIGHT
    expected = (keep + 1) / (0.5 * keep + 1.5)
    assert admission.throughput == pytest.approx(expected)
    assert admission.service_rate == pytest.approx(expected)  # not capacity / 0.5 s = 2
    clock.now += 10.0  # idle, not backlogged: c alone neither counts nor spoils the rate
    async with admission.slot(c):
        clock.now += 0.5
    assert admission.throughput == pytest.approx(expected)
    assert admission.mean_service_s == pytest.approx(0.5)
    assert admission.queued == 0 and admission.running == 0


async def test_a_failed_or_cancelled_request_does_not_count_as_a_service_time() -> None:
    admission = gate()
    await measure(admission, 0.5)
    with admission.enter() as ticket, pytest.raises(RuntimeError):
        async with admission.slot(ticket):
            clock_of(admission).now += 50.0
            raise RuntimeError("kernel failed")
    assert admission.mean_service_s == pytest.approx(0.5)
    assert admission.completed == 1 and admission.running == 0 and admission.queued == 0


async def test_expected_wait_counts_the_requests_ahead_beyond_the_free_slots() -> None:
    admission = gate(capacity=2)
    await measure(admission, 0.5)  # rate: 2 slots / 0.5 s = 4 requests per second
    assert admission.expected_wait_s(0) == admission.expected_wait_s(1) == 0.0  # a slot free
    admission.running = 2
    assert admission.expected_wait_s(0) == pytest.approx(0.25)  # the next completion
    assert admission.expected_wait_s(3) == pytest.approx(1.0)
    admission.running = 0


async def test_nothing_is_refused_for_time_before_the_first_measurement() -> None:
    admission = gate(capacity=1)
    async with AsyncExitStack() as stack:
        running = stack.enter_context(admission.enter(0, 0.001))
        await stack.enter_async_context(admission.slot(running))
        tickets = [admission.enter(0, 0.001) for _ in range(50)]  # all would wait
        assert admission.queued == 50 and admission.refused[DEADLINE] == 0
        for ticket in tickets:
            ticket.close()


async def test_a_request_that_cannot_make_its_deadline_is_refused_at_once() -> None:
    admission = gate(capacity=1)
    await measure(admission, 0.1)  # 10 requests per second
    async with AsyncExitStack() as stack:
        first = stack.enter_context(admission.enter(0, 0.05))
        # a free slot: it does not wait, so it is let in whatever its deadline
        await stack.enter_async_context(admission.slot(first))
        # the slot is busy: wait 0.1 s + service 0.1 s = 0.2 s
        error = refused(DEADLINE, admission, 0, 0.19)
        assert "expected to finish in 200 ms (wait 100 ms + service 100 ms)" in str(error)
        assert "past its deadline in 190 ms" in str(error)
        waiting = [admission.enter(0, 0.21)]  # makes it: admitted
        # one ahead now: wait 0.2 + service 0.1 = 0.3 s
        refused(DEADLINE, admission, 0, 0.29)
        waiting.append(admission.enter(0, 0.31))
        waiting.append(admission.enter(0, None))  # no deadline: never refused for time
        assert admission.queued == 3 and admission.refused == {
            DEADLINE: 2, MAX_QUEUE: 0, MAX_QUEUE_BYTES: 0
        }
        assert admission.statistics().expected_wait_s == pytest.approx(0.4)
        for ticket in waiting:
            ticket.close()
    assert admission.queued == 0 and admission.running == 0


async def test_slot_checks_the_requests_own_deadline_against_those_waiting_ahead() -> None:
    admission = gate(capacity=1)
    await measure(admission, 0.1)
    loop = asyncio.get_running_loop()
    async with AsyncExitStack() as stack:
        first = stack.enter_context(admission.enter())
        await stack.enter_async_context(admission.slot(first))
        ahead = admission.enter()
        waiter = loop.create_task(_hold(admission, ahead))
        await _until(lambda: len(admission._waiters) == 1)
        late = admission.enter()  # no deadline known before its body is read
        with pytest.raises(ProtocolError, match="1 request\\(s\\) ahead"):
            async with admission.slot(late, remaining_s=0.25):  # 0.2 wait + 0.1 service
                pass
        late.close()
        assert admission.refused[DEADLINE] == 1 and admission.queued == 1
    await waiter
    assert admission.queued == 0 and admission.running == 0


async def test_the_request_cap_refuses_beyond_the_free_slots() -> None:
    admission = gate(capacity=2, max_queue=3)
    tickets = [admission.enter() for _ in range(5)]  # 2 will find slots, 3 wait
    error = refused(MAX_QUEUE, admission)
    assert "0 request(s) running and 5 queued (max queue 3, --max-queue)" in str(error)
    for ticket in tickets:
        ticket.close()
    tickets = [admission.enter() for _ in range(5)]
    for ticket in tickets:
        ticket.close()


async def test_the_bytes_cap_refuses_at_its_bound() -> None:
    admission = gate(capacity=1, max_queue_bytes=1000)
    alone = admission.enter(5000)  # a lone request is always let in (the body limit bounds it)
    alone.close()
    first = admission.enter(600)
    second = admission.enter(400)  # exactly at the bound
    assert admission.statistics().queued_bytes == 1000
    error = refused(MAX_QUEUE_BYTES, admission, 1)
    assert "2 queued request(s) hold 1000 bytes; 1 more would pass the cap of 1000" in str(error)
    second.close()
    third = admission.enter(0)  # unknown length: counted when read
    with pytest.raises(ProtocolError, match="this body's 401 bytes would pass the cap") as info:
        third.resize(401)
    assert info.value.status == 503 and admission.refused[MAX_QUEUE_BYTES] == 2
    third.resize(400)
    assert admission.pending_bytes == 1000
    third.close()
    third.close()  # closing twice is harmless
    first.close()
    assert admission.pending_bytes == 0 and admission.queued == 0


async def test_a_cancelled_waiter_gives_back_its_place_and_its_bytes() -> None:
    admission = gate(capacity=1)
    async with AsyncExitStack() as stack:
        first = stack.enter_context(admission.enter(10))
        await stack.enter_async_context(admission.slot(first))
        second = admission.enter(20)
        task = asyncio.get_running_loop().create_task(_hold(admission, second))
        await _until(lambda: len(admission._waiters) == 1)
        assert admission.statistics().queued_bytes == 20
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.queued == 0 and admission.pending_bytes == 0
    assert admission.running == 0


async def _hold(admission: Admission, ticket: Ticket) -> None:
    with ticket:
        async with admission.slot(ticket):
            pass


async def _until(condition: object) -> None:
    assert callable(condition)
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")
