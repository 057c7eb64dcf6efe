"""Dynamic batching: concurrent requests run as one execution, and each caller still gets
exactly what running alone gives, its own errors, and its own cancellation."""

from __future__ import annotations

import asyncio
import threading
import warnings
from typing import Any

import pytest
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.export import Dim

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.errors import BatchingError, InputValidationError
from asyncgraph.runtime.batching import Batcher, BatchLayout
from asyncgraph.runtime.placement import batch_bucket_key
from asyncgraph.testing import FaultInjector
from tests.support.models import Counter

pytestmark = pytest.mark.usefixtures("leak_check")

BATCH = Dim("batch", min=1, max=64)


class Rows(torch.nn.Module):
    """Row-independent: a per-position MLP over [batch, seq, 8], and a mean over seq."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x) * scale, x.mean(1)


class Lookup(torch.nn.Module):
    """An embedding: an index out of range fails inside the kernel, for one row only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum(1)


class RowsAndCount(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x * 2, x.shape[0] * 2


class SumOverBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


def _export(model: torch.nn.Module, args: tuple[Any, ...], dynamic: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), args, dynamic_shapes=dynamic)


@pytest.fixture(scope="module")
def rows_program() -> tuple[torch.nn.Module, Any]:
    model = Rows()
    seq = Dim("seq", min=1, max=32)
    ep = _export(model, (torch.randn(2, 3, 8), torch.randn(2, 1, 1)),
                 ({0: BATCH, 1: seq}, {0: BATCH}))
    return model, ep


@pytest.fixture(scope="module")
def lookup_program() -> tuple[torch.nn.Module, Any]:
    model = Lookup()
    return model, _export(model, (torch.zeros(2, 5, dtype=torch.long),), ({0: BATCH},))


def _batched(**kw: Any) -> ExecutorConfig:
    return ExecutorConfig(batching=BatchingConfig(**kw))


def _request(rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, seq, 8, generator=g), torch.rand(rows, 1, 1, generator=g) + 0.5


def _alone(model: torch.nn.Module, *args: torch.Tensor) -> Any:
    with torch.inference_mode():
        return model(*args)


# -- results -------------------------------------------------------------------------------


async def test_concurrent_requests_share_batches_and_match_running_alone(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    model, ep = rows_program
    requests = [_request(rows=1 + i % 3, seq=(4, 6)[i % 2], seed=i) for i in range(24)]
    async with Executor(ep, _batched(max_batch_size=8)) as ex:
        outs = await asyncio.gather(*(ex.execute(x, s) for x, s in requests))
        stats = ex.batching_statistics()
    for (x, s), (y, m) in zip(requests, outs, strict=True):
        want_y, want_m = _alone(model, x, s)
        assert y.shape == want_y.shape and m.shape == want_m.shape
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m, want_m, rtol=1e-5, atol=1e-5)
    assert stats is not None
    assert stats.requests == 24 and stats.rows == sum(x.shape[0] for x, _ in requests)
    assert stats.batches < 24  # requests of the same seq length were stacked
    assert stats.largest_batch <= 8
    assert stats.queued == stats.running == 0


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([2, 5]), st.integers(0, 2)),
                  min_size=1, max_size=12),
    max_batch=st.integers(1, 6),
    concurrent=st.integers(1, 3),
)
async def test_any_arrival_pattern_gives_each_caller_its_own_rows(
    rows_program: tuple[torch.nn.Module, Any],
    plan: list[tuple[int, int, int]],
    max_batch: int,
    concurrent: int,
) -> None:
    """Row counts, shapes, batch limits and arrival gaps (loop iterations) drawn at random."""
    model, ep = rows_program
    config = _batched(max_batch_size=max_batch, max_concurrent_batches=concurrent)
    async with Executor(ep, config) as ex:

        async def call(i: int, rows: int, seq: int, gap: int) -> None:
            for _ in range(gap * i):
                await asyncio.sleep(0)
            x, s = _request(rows, seq, seed=i)
            y, m = await ex.execute(x, s)
            want_y, want_m = _alone(model, x, s)
            torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(m, want_m, rtol=1e-5, atol=1e-5)

        await asyncio.gather(*(call(i, *p) for i, p in enumerate(plan)))
        stats = ex.batching_statistics()
    assert stats is not None and stats.requests == len(plan)
    assert stats.largest_batch <= max(max_batch, max(rows for rows, _, _ in plan))


async def test_requests_that_arrive_apart_run_alone_without_delay(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    async with Executor(ep, _batched()) as ex:
        for i in range(3):
            await ex.execute(*_request(1, 3, seed=i))
        stats = ex.batching_statistics()
    assert stats is not None and (stats.batches, stats.largest_batch) == (3, 1)


async def test_max_delay_holds_a_batch_for_later_requests(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    async with Executor(ep, _batched(max_delay_s=0.5, max_batch_size=2)) as ex:
        first = asyncio.create_task(ex.execute(*_request(1, 3, seed=0)))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(ex.execute(*_request(1, 3, seed=1)))
        await asyncio.gather(first, second)  # the batch is full at 2 rows: no wait for 0.5 s
        stats = ex.batching_statistics()
    assert stats is not None and (stats.batches, stats.largest_batch) == (1, 2)


@pytest.mark.timeout(60)
async def test_a_batch_that_fills_leaves_at_once_whatever_the_delay(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    """max_delay_s waits for a batch that is not full; a request that fills it while the delay
    timer is pending starts the batch in that loop iteration, not when the timer fires."""
    _, ep = rows_program
    ex = Executor(ep, _batched(max_delay_s=30.0, max_batch_size=2))
    try:
        first = asyncio.create_task(ex.execute(*_request(1, 3, seed=0)))
        for _ in range(5):  # queued, and the 30 s delay timer armed
            await asyncio.sleep(0)
        stats = ex.batching_statistics()
        assert stats is not None and (stats.queued, stats.batches) == (1, 0)
        second = asyncio.create_task(ex.execute(*_request(1, 3, seed=1)))
        for _ in range(5):
            await asyncio.sleep(0)
        stats = ex.batching_statistics()
        assert stats is not None and (stats.batches, stats.largest_batch) == (1, 2)
        await asyncio.gather(first, second)
    finally:
        await ex.aclose()  # closing runs what is queued at once: no 30 s wait on failure


@pytest.mark.timeout(60)
async def test_closing_runs_a_delayed_batch_without_waiting_for_its_timer(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    ex = Executor(ep, _batched(max_delay_s=30.0, max_batch_size=4))
    first = asyncio.create_task(ex.execute(*_request(1, 3, seed=0)))
    for _ in range(5):  # queued, and the 30 s delay timer armed
        await asyncio.sleep(0)
    closing = asyncio.create_task(ex.aclose())
    try:
        for _ in range(50):  # a few loop iterations to run the batch, not 30 s
            await asyncio.sleep(0)
            if first.done():
                break
        assert first.done() and first.result()[0].shape == (1, 3, 4)
    finally:
        first.cancel()
        await asyncio.gather(first, closing, return_exceptions=True)


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.mark.parametrize(("width", "off_loop"), [(65536, True), (16, False)],
                         ids=["2MB-on-a-thread", "512B-inline"])
async def test_a_large_batch_is_stacked_off_the_loop(
    monkeypatch: pytest.MonkeyPatch, width: int, off_loop: bool
) -> None:
    """8 rows of 256 KB stack to 2 MB: torch.cat runs on a thread, not the loop's; 8 rows of
    64 B stay inline (a thread hop costs more than the copy)."""
    ep = _export(Scale(), (torch.randn(2, width),), ({0: BATCH},))
    joined_on: list[int] = []
    join = Batcher._join

    def recording_join(self: Batcher, batch: Any, pad: int) -> list[Any]:
        joined_on.append(threading.get_ident())
        return join(self, batch, pad)

    monkeypatch.setattr(Batcher, "_join", recording_join)
    xs = [torch.randn(1, width, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    async with Executor(ep, _batched(max_batch_size=8)) as ex:
        outs = await asyncio.gather(*(ex.execute(x) for x in xs))
        stats = ex.batching_statistics()
    assert stats is not None and stats.batches == 1 and stats.largest_batch == 8
    for x, y in zip(xs, outs, strict=True):
        torch.testing.assert_close(y, x * 2 + 1)
    loop_thread = threading.get_ident()
    assert len(joined_on) == 1 and (joined_on[0] != loop_thread) == off_loop


# -- errors --------------------------------------------------------------------------------


async def test_a_request_that_fails_in_a_batch_fails_alone(
    lookup_program: tuple[torch.nn.Module, Any],
) -> None:
    model, ep = lookup_program
    good = [torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(i))
            for i in range(5)]
    bad = torch.full((1, 5), 99, dtype=torch.long)  # out of the embedding's range
    async with Executor(ep, _batched()) as ex:
        results = await asyncio.gather(
            *(ex.execute(x) for x in [*good[:2], bad, *good[2:]]), return_exceptions=True
        )
        stats = ex.batching_statistics()
    assert isinstance(results[2], IndexError)
    for x, out in zip(good, [*results[:2], *results[3:]], strict=True):
        torch.testing.assert_close(out, _alone(model, x))
    assert stats is not None and stats.retried_alone == 1 and stats.batches == 1


async def test_without_retry_every_request_of_a_failed_batch_gets_the_error(
    lookup_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = lookup_program
    requests = [torch.zeros(1, 5, dtype=torch.long), torch.full((1, 5), 99, dtype=torch.long)]
    async with Executor(ep, _batched(retry_alone=False)) as ex:
        results = await asyncio.gather(*(ex.execute(x) for x in requests),
                                       return_exceptions=True)
    assert all(isinstance(r, IndexError) for r in results)


async def test_an_invalid_request_is_rejected_before_it_queues(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    async with Executor(ep, _batched()) as ex:
        x, s = _request(2, 3, seed=0)
        good = asyncio.create_task(ex.execute(x, s))
        with pytest.raises(InputValidationError, match=r"dtype.*float32.*float64"):
            await ex.execute(x.double(), s)
        with pytest.raises(InputValidationError, match=r"shape\[0\]: expected 2"):
            await ex.execute(x, s[:1])  # rows disagree between the inputs
        await good
        stats = ex.batching_statistics()
    assert stats is not None and stats.requests == 1


@pytest.mark.parametrize(
    ("model", "args", "dynamic", "message"),
    [
        (Rows(), (torch.randn(2, 3, 8), torch.randn(2, 1, 1)), None,
         r"input 'x' has shape \[2, 3, 8\].*Dim\('batch'\)"),
        (SumOverBatch(), (torch.randn(4, 8),), ({0: BATCH},),
         r"output 0 has shape \[8\]"),
        (RowsAndCount(), (torch.randn(4, 8),), ({0: BATCH},), r"output 1 is int"),
        (Counter(), (torch.randn(3, 4),), ({0: BATCH},), r"mutates no inputs or buffers"),
    ],
    ids=["static-batch", "reduces-over-batch", "scalar-output", "mutates-buffer"],
)
async def test_a_program_that_cannot_batch_is_refused_with_the_reason(
    model: torch.nn.Module, args: tuple[Any, ...], dynamic: Any, message: str
) -> None:
    ep = _export(model, args, dynamic)
    with pytest.raises(BatchingError, match=message):
        Executor(ep, _batched())


async def test_max_batch_size_above_the_exported_range_is_refused(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    with pytest.raises(BatchingError, match=r"max_batch_size 65 .* <= 64"):
        Executor(ep, _batched(max_batch_size=65))


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"max_batch_size": 0}, "max_batch_size"), ({"max_delay_s": -1}, "max_delay_s"),
     ({"max_concurrent_batches": 0}, "max_concurrent_batches")],
)
def test_batching_config_rejects_bad_values(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchingConfig(**kw)


# -- cancellation and closing --------------------------------------------------------------


def _gated(ep: Any, **kw: Any) -> tuple[Executor, Any]:
    """Every node on a worker, the first linear blocked behind a gate: a batch in flight
    that the test releases."""
    faults = FaultInjector()
    gate = faults.block("linear")
    config = ExecutorConfig(
        heavy_op_flops=0, adaptive_placement=False, batching=BatchingConfig(**kw)
    )
    return Executor(ep, config, kernel_factory=faults.kernel_factory()), gate


async def test_a_request_cancelled_in_the_queue_leaves_it(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    model, ep = rows_program
    ex, gate = _gated(ep, max_concurrent_batches=1)
    async with ex:
        first = asyncio.create_task(ex.execute(*_request(1, 3, seed=0)))
        await gate.wait_entered(1)
        cancelled = asyncio.create_task(ex.execute(*_request(1, 3, seed=1)))
        kept_inputs = _request(2, 3, seed=2)
        kept = asyncio.create_task(ex.execute(*kept_inputs))
        for _ in range(3):
            await asyncio.sleep(0)
        cancelled.cancel()
        gate.open()
        await first
        y, _m = await kept
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        stats = ex.batching_statistics()
    torch.testing.assert_close(y, _alone(model, *kept_inputs)[0], rtol=1e-5, atol=1e-5)
    assert stats is not None
    assert stats.cancelled_in_queue == 1 and stats.batches == 2 and stats.rows == 3


async def test_a_batch_whose_callers_all_left_is_cancelled(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    ex, gate = _gated(ep)
    async with ex:
        callers = [asyncio.create_task(ex.execute(*_request(1, 3, seed=i))) for i in range(2)]
        await gate.wait_entered(1)
        for task in callers:
            task.cancel()
        await asyncio.sleep(0.01)
        gate.open()  # the worker thread finishes its kernel; the execution then stops
        for task in callers:
            with pytest.raises(asyncio.CancelledError):
                await task
    stats = ex.statistics()  # aclose waited for the batch to stop
    assert (stats.cancelled, stats.completed) == (1, 0)


@pytest.mark.parametrize("cancel", [False, True], ids=["drain", "cancel"])
async def test_aclose_runs_or_cancels_the_queued_requests(
    rows_program: tuple[torch.nn.Module, Any], cancel: bool
) -> None:
    _, ep = rows_program
    ex, gate = _gated(ep, max_concurrent_batches=1)
    first = asyncio.create_task(ex.execute(*_request(1, 3, seed=0)))
    await gate.wait_entered(1)
    queued = asyncio.create_task(ex.execute(*_request(1, 3, seed=1)))
    await asyncio.sleep(0)
    closing = asyncio.create_task(ex.aclose(cancel=cancel))
    await asyncio.sleep(0.01)
    gate.open()
    await closing
    results = await asyncio.gather(first, queued, return_exceptions=True)
    if cancel:
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
    else:  # accepted requests still run
        assert [r[0].shape for r in results] == [(1, 3, 4)] * 2  # type: ignore[index]


# -- placement -----------------------------------------------------------------------------


def test_batch_sizes_share_placement_signatures_by_power_of_two() -> None:
    def key(rows: int) -> Any:
        return batch_bucket_key([torch.empty(rows, 3), 2.0])

    assert key(5) == key(8) != key(9)
    assert key(1) != key(2) and key(3) == key(4)
    assert key(0) == key(1)


async def test_varying_batch_sizes_profile_a_few_signatures(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    _, ep = rows_program
    async with Executor(ep, _batched(max_batch_size=16)) as ex:
        for rows in list(range(1, 17)) * 2:
            await ex.execute(*_request(rows, 3, seed=rows))
        placement = ex.placement_statistics()
    assert placement is not None and placement.signatures == 5  # 1, 2, 4, 8, 16


def test_batch_keys_separate_what_cannot_be_stacked() -> None:
    """Requests share a batch only with equal shapes past dim 0, dtypes and non-tensor inputs;
    a request the key cannot compare (an unhashable value, a tensor in a non-tensor place,
    which only validate_inputs=False lets through) gets a key of its own."""
    layout = BatchLayout((True, False), sympy.Symbol("s0"), 8)
    batcher = Batcher(layout, BatchingConfig(max_batch_size=8), _never_run)

    def key(*flat: Any) -> Any:
        return batcher._rows_and_key(list(flat))

    x3, x2 = torch.zeros(3, 4), torch.zeros(2, 4)
    assert key(x3, 1.5) == (3, key(x2, 1.5)[1])
    assert key(x3, 1.5)[1] != key(x3, 2.5)[1]
    assert key(x3, 1.5)[1] != key(torch.zeros(3, 5), 1.5)[1]
    assert key(x3, 1.5)[1] != key(x3.double(), 1.5)[1]
    for odd in ([1, 2], torch.ones(2)):
        assert key(x3, odd)[1] != key(x3, odd)[1]


def test_a_repeated_signature_gets_the_key_computed_for_it_requires_grad_included() -> None:
    """The key is remembered for the validated signature, but requires_grad (outside the
    signature) is read every time, and a key of its own is never handed on."""
    layout = BatchLayout((True, False), sympy.Symbol("s0"), 8)
    batcher = Batcher(layout, BatchingConfig(max_batch_size=8), _never_run)
    x, scale = torch.zeros(3, 4), 1.5
    signature = ("the validator's signature of", x.shape)
    rows, key = batcher._rows_and_key([x, scale], signature)
    assert batcher._rows_and_key([torch.ones(3, 4), scale], signature) == (rows, key)
    grad_rows, grad_key = batcher._rows_and_key([x.requires_grad_(), scale], signature)
    assert grad_rows == 3 and grad_key != key
    assert batcher._rows_and_key([x.detach(), scale], signature) == (rows, key)
    odd = [torch.zeros(3, 4), torch.ones(2)]  # a tensor in the scalar's place: a key alone
    assert batcher._rows_and_key(odd, ("other",))[1] != batcher._rows_and_key(odd, ("other",))[1]


def test_without_validation_a_repeated_signature_is_found_by_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With validation off the batcher computes the inputs' signature itself (a new object
    each request) and finds the last one by value: the rows and key are worked out again only
    for a new shape, dtype, scalar value or requires_grad."""
    layout = BatchLayout((True, False), sympy.Symbol("s0"), 8)
    batcher = Batcher(layout, BatchingConfig(max_batch_size=8), _never_run)
    computed = []
    compute = batcher._compute_rows_and_key

    def counted(flat: Any) -> Any:
        computed.append(1)
        return compute(flat)

    monkeypatch.setattr(batcher, "_compute_rows_and_key", counted)
    first = batcher._rows_and_key([torch.zeros(3, 4), 1.5])
    assert batcher._rows_and_key([torch.ones(3, 4), 1.5]) == first and len(computed) == 1
    assert batcher._rows_and_key([torch.ones(2, 4), 1.5])[0] == 2 and len(computed) == 2
    assert batcher._rows_and_key([torch.ones(2, 4), 2.5])[1] != first[1] and len(computed) == 3
    grad = batcher._rows_and_key([torch.ones(2, 4, requires_grad=True), 2.5])
    assert len(computed) == 4 and grad[1] != first[1]
    odd = [torch.zeros(3, 4), [1, 2]]  # no signature (a list): worked out every time
    assert batcher._rows_and_key(odd)[1] != batcher._rows_and_key(odd)[1]
    assert len(computed) == 6


def test_stacked_bytes_counts_every_row_of_the_batch() -> None:
    from asyncgraph.runtime.batching import _Request

    layout = BatchLayout((True, False), sympy.Symbol("s0"), 8)
    batcher = Batcher(layout, BatchingConfig(max_batch_size=8), _never_run)
    requests = [_Request([torch.zeros(rows, 4), 1.5], rows, (), None) for rows in (3, 1, 4)]
    assert batcher._stacked_bytes(requests) == 8 * 4 * 4
    empty = [_Request([torch.zeros(0, 4), 1.5], 0, (), None), requests[0]]
    assert batcher._stacked_bytes(empty) == 3 * 4 * 4


async def _never_run(flat: list[Any]) -> list[Any]:
    raise AssertionError("not expected to run")


# -- padding to batch-size buckets ---------------------------------------------------------


def test_default_buckets_are_vllms_sizes_up_to_the_largest_batch() -> None:
    """1, 2, 4, then multiples of 8 (vLLM's capture sizes), thinned to MAX_DEFAULT_BUCKETS."""
    from asyncgraph.runtime.batching import MAX_DEFAULT_BUCKETS, default_buckets

    assert default_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert default_buckets(12) == (1, 2, 4, 8, 12)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_buckets(1) == (1,)
    for largest in range(1, 600):
        buckets = default_buckets(largest)
        assert len(buckets) <= MAX_DEFAULT_BUCKETS and buckets[-1] == largest, largest
        assert list(buckets) == sorted(set(buckets)), largest
    layout = BatchLayout((True,), sympy.Symbol("s0"), 24, default_buckets(24))
    assert [layout.padding(r) for r in (0, 1, 3, 5, 16, 17, 24, 30)] == [0, 0, 1, 3, 0, 7, 0, 0]


@pytest.mark.parametrize(
    "buckets", [(2, 1), (1, 1), (0, 4), (1, 2, 16)], ids=["falling", "repeated", "zero", "big"]
)
def test_buckets_must_rise_from_one_to_max_batch_size(buckets: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"buckets must be strictly increasing .* \(8\)"):
        BatchingConfig(max_batch_size=8, buckets=buckets)


async def test_batches_are_padded_to_the_next_bucket_and_the_padding_dropped() -> None:
    """The run sees only bucket sizes, padded with copies of the last row; each caller gets
    exactly its own rows back."""
    seen: list[int] = []

    async def run(flat: list[Any]) -> list[Any]:
        x, scale = flat
        seen.append(x.shape[0])
        return [x * scale]

    layout = BatchLayout((True, False), sympy.Symbol("s0"), 8, (1, 2, 4, 8))
    batcher = Batcher(layout, BatchingConfig(max_batch_size=8), run)
    rows = [3, 1, 2, 5, 1]
    xs = [torch.full((r, 2), float(i + 1)) for i, r in enumerate(rows)]
    outs = await asyncio.gather(*(batcher.submit([x, 2.0]) for x in xs))
    await batcher.aclose()
    assert all(size in (1, 2, 4, 8) for size in seen), seen
    stats = batcher.statistics()
    assert stats.padded_rows == sum(seen) - sum(rows) > 0
    assert stats.rows == sum(rows)
    for x, (out,) in zip(xs, outs, strict=True):
        assert out.shape == x.shape  # the padding's rows went to no caller
        torch.testing.assert_close(out, x * 2.0)


async def test_a_padded_request_that_fails_is_retried_unpadded() -> None:
    """A size the program refuses (say, a guard on the batch) must not fail a request that
    would run as it came."""
    seen: list[int] = []

    async def run(flat: list[Any]) -> list[Any]:
        seen.append(flat[0].shape[0])
        if flat[0].shape[0] == 4:
            raise RuntimeError("4 rows refused")
        return [flat[0] + 1]

    layout = BatchLayout((True,), sympy.Symbol("s0"), 4, (1, 2, 4))
    batcher = Batcher(layout, BatchingConfig(max_batch_size=4, retry_alone=False), run)
    (out,) = await batcher.submit([torch.zeros(3, 2)])
    await batcher.aclose()
    torch.testing.assert_close(out, torch.ones(3, 2))
    assert seen == [4, 3]
    assert batcher.statistics().retried_alone == 1


async def test_a_cpu_executor_pads_only_when_asked(
    rows_program: tuple[torch.nn.Module, Any],
) -> None:
    model, ep = rows_program
    for buckets, padded in ((None, False), ((1, 2, 4, 8), True)):
        async with Executor(ep, _batched(max_batch_size=8, buckets=buckets)) as ex:
            requests = [_request(rows=3, seq=4, seed=i) for i in range(3)]
            outs = await asyncio.gather(*(ex.execute(x, s) for x, s in requests))
            stats = ex.batching_statistics()
        for (x, s), (y, m) in zip(requests, outs, strict=True):
            want_y, want_m = _alone(model, x, s)
            torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(m, want_m, rtol=1e-5, atol=1e-5)
        assert stats is not None and (stats.padded_rows > 0) is padded
