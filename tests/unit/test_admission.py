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
    Admission,
    Calibration,
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


async def measure(
    admission: Admission, *service_s: float, decode_s: float | None = None,
    encode_s: float | None = None, nbytes: int = 0,
) -> None:
    """Run requests one after another that each hold a slot for `service_s` fake seconds,
    after `decode_s` in the decode lane and before `encode_s` encoding (when given), with
    bodies of `nbytes`."""
    clock = clock_of(admission)
    for seconds in service_s:
        with admission.enter(nbytes) as ticket:
            if decode_s is not None:
                async with admission.decoding(ticket):
                    clock.now += decode_s
            async with admission.slot(ticket):
                clock.now += seconds
        if encode_s is not None:
            with admission.encoding():
                clock.now += encode_s


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


async def test_the_decode_lane_measures_decode_and_encode_as_loop_time_per_request() -> None:
    """Decoding and encoding hold the event loop: the gate measures them per request, and the
    rate it serves at is the slower of the loop (1 / that time) and the slots."""
    admission = gate(capacity=4)
    await measure(admission, 0.2, decode_s=0.05, encode_s=0.01)
    assert admission.mean_decode_s == pytest.approx(0.05)
    assert admission.mean_encode_s == pytest.approx(0.01)
    assert admission.service_rate == pytest.approx(1 / 0.06)  # not 4 / 0.2 = 20
    await measure(admission, 0.2, decode_s=0.15, encode_s=0.01)
    assert admission.mean_decode_s == pytest.approx(0.05 + SERVICE_EWMA_WEIGHT * 0.1)
    stats = admission.statistics()
    assert stats.mean_decode_s == admission.mean_decode_s and stats.decoding == 0


async def test_a_decode_bound_overload_is_refused_on_arrival() -> None:
    """The issue's decode-bound model: 10 ms of JSON decode on the loop, 0.1 ms of execution,
    8 free slots. Requests admitted and not yet decoded queue for the loop, one after another:
    with a 100 ms deadline at most 9 fit ahead of a new one, whatever the free slots say."""
    admission = gate(capacity=8)
    await measure(admission, 0.0001, decode_s=0.01)
    admitted: list[Ticket] = []
    for _ in range(50):
        try:
            admitted.append(admission.enter(1000, 0.1))
        except ProtocolError as exc:
            assert exc.status == 503
    # the k-th admitted expects (k + 1) x 10 ms of decode, then 0.1 ms of execution
    assert len(admitted) == 9 and admission.refused[DEADLINE] == 41
    error = refused(DEADLINE, admission, 1000, 0.1)
    assert "9 request(s) ahead" in str(error) and "9 to decode at 10.0 ms each" in str(error)
    assert "expected to finish in 100 ms" in str(error)
    for ticket in admitted:
        ticket.close()
    assert admission.queued == 0


async def test_the_decode_lane_gives_the_loop_a_turn_between_long_decodes() -> None:
    """A decode holds the loop. Once decodes have held it for the slice (0 here: every
    decode is long), the next one waits for a loop turn of its own, so whatever became ready
    meanwhile (a request to refuse, a completion) runs before it; one at a time, in order."""
    admission = Admission("m", 8, 1000, 1 << 30, clock=FakeClock(), lane_slice_s=0.0)
    order: list[str] = []
    loop = asyncio.get_running_loop()

    async def decode(name: str) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                order.append(name)
                loop.call_soon(order.append, f"after {name}")  # e.g. a new arrival

    tasks = [loop.create_task(decode(name)) for name in ("a", "b", "c")]
    loop.call_soon(order.append, "arrival")  # ready before any decode has run
    await _until(lambda: len(order) == 1)
    assert admission.statistics().decoding == 3  # one in the lane, two waiting for it
    await asyncio.gather(*tasks)
    assert order == ["arrival", "a", "after a", "b", "after b", "c", "after c"]
    assert admission.queued == 0 and admission.statistics().decoding == 0


async def test_a_request_costs_the_loop_the_interval_between_decodes_when_they_queue() -> None:
    """The loop does more per request than its decode and encode (reading the body, answering
    refusals, completing executions). When decodes queue for the lane, the interval from one
    decode's end to the next one's end is what each request ahead costs the requests behind
    it: that is the loop time the estimate counts."""
    admission = Admission("m", 8, 1000, 1 << 30, clock=FakeClock(), lane_slice_s=0.0)
    clock = clock_of(admission)
    loop = asyncio.get_running_loop()
    first_in = asyncio.Event()
    others_done = asyncio.Event()

    async def decode(first: bool) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                if first:
                    first_in.set()
                    await others_done.wait()  # the second asks for the lane meanwhile
                clock.now += 0.01
        if first:
            clock.now += 0.02  # the loop's other work before the next decode starts

    first = loop.create_task(decode(True))
    await first_in.wait()
    second = loop.create_task(decode(False))
    await _until(lambda: admission.statistics().decoding == 2)
    others_done.set()
    await asyncio.gather(first, second)
    assert admission.mean_decode_s == pytest.approx(0.01)
    assert admission.mean_turn_s == pytest.approx(0.03)  # 0.02 of other work + 0.01 decode
    assert admission.loop_s == pytest.approx(0.03)
    assert admission.statistics().mean_turn_s == pytest.approx(0.03)


async def test_the_interval_between_decodes_is_shared_by_the_requests_that_arrived_in_it(
) -> None:
    """A burst's requests are read in a few long loop turns, each request once, while each
    lane hand-off takes a turn of its own: the interval before a queued decode is shared by
    the requests that arrived in it, not charged in full to each request ahead."""
    admission = Admission("m", 8, 1000, 1 << 30, clock=FakeClock(), lane_slice_s=0.0)
    clock = clock_of(admission)
    loop = asyncio.get_running_loop()
    first_in = asyncio.Event()
    others_done = asyncio.Event()
    burst: list[Ticket] = []

    async def decode(first: bool) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                if first:
                    first_in.set()
                    await others_done.wait()
                clock.now += 0.001
        if first:  # the loop reads a burst of 9 arrivals before the next decode: 90 ms
            burst.extend(admission.enter() for _ in range(9))
            clock.now += 0.09

    first = loop.create_task(decode(True))
    await first_in.wait()
    second = loop.create_task(decode(False))
    await _until(lambda: admission.statistics().decoding == 2)
    others_done.set()
    await asyncio.gather(first, second)
    assert admission.mean_turn_s == pytest.approx(0.091 / 9)  # not 91 ms per request ahead
    for ticket in burst:
        ticket.close()


async def test_short_decodes_run_together_within_the_slice() -> None:
    """Decodes that together hold the loop less than the slice run back to back in the loop
    turn they became ready in, as they would without the lane (a batcher sees them together)."""
    admission = Admission("m", 8, 1000, 1 << 30, clock=FakeClock(), lane_slice_s=3600.0)
    order: list[str] = []
    loop = asyncio.get_running_loop()

    async def decode(name: str) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                order.append(name)

    await decode("first")  # opens the slice
    tasks = [loop.create_task(decode(name)) for name in ("a", "b", "c")]
    loop.call_soon(order.append, "arrival")
    await asyncio.gather(*tasks)
    assert order == ["first", "a", "b", "c", "arrival"]


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


#: Calibrated at start-up: a 1000-byte body decodes in 10 ms, executes in 5 ms, encodes in 0.
CALIBRATED = Calibration(body_bytes=1000, decode_s=0.01, execute_s=0.005, encode_s=0.0, rounds=3)


def admit_until_refused(admission: Admission, nbytes: int, remaining_s: float) -> list[Ticket]:
    """Admit requests of a burst until one is refused; the admitted tickets."""
    admitted: list[Ticket] = []
    while True:
        try:
            admitted.append(admission.enter(nbytes, remaining_s))
        except ProtocolError as exc:
            assert exc.status == 503
            return admitted


async def test_a_calibrated_gate_admits_a_first_burst_as_far_as_its_deadline_allows() -> None:
    """Calibrated at start-up, the gate predicts before any request completes: with 2 slots
    and 10 ms of decode per request, a first burst with a 100 ms deadline is admitted while
    the decodes ahead fit (the k-th expects (k + 1) x 10 ms + 5 ms of execution: 9 of them),
    not only what the slots hold; the rest is refused at once."""
    admission = gate(capacity=2)
    admission.calibrate(CALIBRATED)
    assert admission.measured and admission.completed == 0
    admitted = admit_until_refused(admission, 1000, 0.1)
    assert len(admitted) == 9 and admission.refused[DEADLINE] == 1
    error = refused(DEADLINE, admission, 1000, 0.1)
    assert "9 to decode at 10.0 ms each" in str(error)
    assert "expected to finish in 105 ms" in str(error)
    stats = admission.statistics()
    assert stats.calibration == CALIBRATED and stats.completed == 0
    assert stats.expected_wait_s == pytest.approx(0.09)
    for ticket in admitted:
        ticket.close()


async def test_with_batching_a_calibrated_first_burst_is_bounded_by_its_estimate() -> None:
    """A batching gate lets frames x max_batch_size requests in (8 x 32 = 256 by default),
    far more than a decode-bound first burst can decode in time; calibrated, it admits as
    many as the decodes ahead allow (1 s / 10 ms: 99 with 5 ms of execution), neither the
    256 it holds nor only the 8 frames."""
    admission = Admission("m", 256, 4096, 1 << 30, clock=FakeClock(), first_burst=8)
    admission.calibrate(CALIBRATED)
    admitted = admit_until_refused(admission, 1000, 1.0)
    assert len(admitted) == 99
    for ticket in admitted:
        ticket.close()


async def test_an_uncalibrated_gate_admits_only_what_the_slots_hold_until_it_measures() -> None:
    """Calibration failed (or never ran: a mounted app), so nothing is measured and nothing
    can be promised: a request with a deadline is admitted while the requests in flight fit
    the slots (with batching, one per frame); the rest of a first burst is refused at once,
    not admitted blindly to miss its deadline. Without a deadline a request is never refused
    for time. Once a request has completed, the gate predicts from it."""
    admission = gate(capacity=2)
    first = admission.enter(0, 1.0)
    second = admission.enter(0, 1.0)
    error = refused(DEADLINE, admission, 0, 1.0)
    assert "nothing measured yet and 2 request(s) in flight fill its first 2 place(s)" in str(
        error
    )
    patient = [admission.enter(0, None) for _ in range(5)]
    assert admission.queued == 7 and admission.refused[DEADLINE] == 1
    for ticket in (first, second, *patient):
        ticket.close()
    await measure(admission, 0.01)
    tickets = [admission.enter(0, 1.0) for _ in range(10)]  # measured: 10 x 5 ms fit in 1 s
    for ticket in tickets:
        ticket.close()
    batching = Admission("m", 256, 4096, 1 << 30, clock=FakeClock(), first_burst=8)
    tickets = [batching.enter(0, 1.0) for _ in range(8)]
    assert "8 request(s) in flight fill its first 8 place(s)" in str(
        refused(DEADLINE, batching, 0, 1.0)
    )
    for ticket in tickets:
        ticket.close()


async def test_a_decode_is_priced_by_its_body_size() -> None:
    """Calibrated at 10 ms for 1000 bytes: a body 10 times larger expects 100 ms of decode,
    and each request ahead costs the loop at the mean size of the bodies ahead."""
    admission = gate(capacity=8)
    admission.calibrate(CALIBRATED)
    assert admission.decode_s(1000) == pytest.approx(0.01)
    assert admission.decode_s(50_000) == pytest.approx(0.5)
    ahead = admission.enter(1000, 1.0)  # nothing ahead of it
    # 10 ms for the one ahead + 500 ms for its own 50 KB + 5 ms of execution
    assert "expected to finish in 515 ms" in str(refused(DEADLINE, admission, 50_000, 0.3))
    large = admission.enter(10_000, 0.3)  # 10 + 100 + 5 ms
    # ahead: 2 bodies of 5500 bytes on average, 55 ms each; its own 1000 bytes 10 ms
    assert "expected to finish in 125 ms" in str(refused(DEADLINE, admission, 1000, 0.12))
    small = admission.enter(1000, 0.13)
    for ticket in (ahead, large, small):
        ticket.close()


async def test_live_measurements_take_over_from_the_calibration() -> None:
    """The calibration seeds the running means; every request measured after it moves them
    like any other sample (decode per byte of its body, slot time, encode)."""
    admission = gate(capacity=2)
    admission.calibrate(CALIBRATED)
    await measure(admission, 0.105, decode_s=0.03, encode_s=0.001, nbytes=1000)
    w = SERVICE_EWMA_WEIGHT
    assert admission.mean_decode_s_per_byte == pytest.approx(1e-5 + w * (3e-5 - 1e-5))
    assert admission.mean_decode_s == pytest.approx(0.01 + w * 0.02)
    assert admission.mean_service_s == pytest.approx(0.005 + w * 0.1)
    assert admission.mean_encode_s == pytest.approx(w * 0.001)
    assert admission.completed == 1 and admission.calibration == CALIBRATED


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


async def _contend_for_the_lane(admission: Admission) -> list[str]:
    """Two decodes that queue for the lane: the second waits while the first holds it."""
    order: list[str] = []
    release = asyncio.Event()

    async def decode(name: str, hold: bool) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                order.append(name)
                if hold:
                    await release.wait()

    first = asyncio.create_task(decode("first", True))
    await _until(lambda: order == ["first"])
    second = asyncio.create_task(decode("second", False))
    await _until(lambda: admission.statistics().decoding == 2)
    release.set()
    await asyncio.gather(first, second)
    return order


def test_the_decode_lane_serves_one_event_loop_after_another() -> None:
    """An app outlives a loop (a test per loop, a server restarted in the same process): the
    lane binds to no loop, so contention on a second loop works as on the first."""
    admission = gate()
    assert asyncio.run(_contend_for_the_lane(admission)) == ["first", "second"]
    assert asyncio.run(_contend_for_the_lane(admission)) == ["first", "second"]
    assert admission.statistics().decoding == 0 and admission.queued == 0


async def test_a_decode_cancelled_in_the_lane_or_waiting_for_it_passes_the_lane_on() -> None:
    admission = Admission("m", 8, 1000, 1 << 30, clock=FakeClock(), lane_slice_s=0.0)
    release = asyncio.Event()
    decoded: list[str] = []

    async def decode(name: str) -> None:
        with admission.enter() as ticket:
            async with admission.decoding(ticket):
                decoded.append(name)
                await release.wait()

    loop = asyncio.get_running_loop()
    holder = loop.create_task(decode("holder"))
    await _until(lambda: decoded == ["holder"])
    waiting = loop.create_task(decode("waiting"))
    last = loop.create_task(decode("last"))
    await _until(lambda: admission.statistics().decoding == 3)
    waiting.cancel()  # gives up its place in the queue
    holder.cancel()  # cancelled inside the lane: passes it on
    await asyncio.gather(holder, waiting, return_exceptions=True)
    await _until(lambda: decoded == ["holder", "last"])
    release.set()
    await last
    assert admission.statistics().decoding == 0 and admission.queued == 0
    assert decoded == ["holder", "last"]


def test_a_body_is_charged_as_it_arrives_and_priced_as_declared() -> None:
    """Issue 39: the server enters a request with nothing charged and its Content-Length to
    price its decode, then grows the ticket chunk by chunk: four requests that declared the
    whole cap and sent 10 bytes each hold 40 bytes, and the next is admitted; bytes that do
    arrive are refused at the cap as before."""
    cap = 4 << 20
    admission = gate(capacity=1, max_queue_bytes=cap)
    tickets = [admission.enter(0, expected_bytes=cap // 4) for _ in range(4)]
    for ticket in tickets:
        ticket.grow(10)
    assert admission.statistics().queued_bytes == 40
    assert admission.pending_priced_bytes == cap  # the estimate prices them as declared
    with admission.enter(0, expected_bytes=100) as fifth:
        fifth.grow(100)
        assert fifth.priced == 100
    tickets[0].grow(cap // 2)
    with pytest.raises(ProtocolError, match=r"would pass the cap of 4194304 bytes") as info:
        tickets[1].grow(cap // 2)
    assert info.value.status == 503 and admission.refused[MAX_QUEUE_BYTES] == 1
    assert tickets[0].priced == cap // 2 + 10  # it outgrew its declared size
    for ticket in tickets:
        ticket.close()
    assert admission.statistics().queued_bytes == 0 and admission.pending_priced_bytes == 0
