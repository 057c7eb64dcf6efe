"""ONNX segments (ExecutorConfig(segments=("onnx",))): runs of aten nodes exported to ONNX when
the Executor is built and run by ONNX Runtime once checked against the plain nodes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from tests.support.models import Chain, eager_output, export_model
from tests.support.soak import full_soak_only

pytest.importorskip("onnxruntime", reason="ONNX segments need the asyncgraph[onnxruntime] extra")
pytest.importorskip("onnxscript", reason="ONNX segments need the asyncgraph[onnxruntime] extra")

import onnx
from conformance.harness import assert_conforms, cached_export, imported
from conformance.models import CASES, CASES_BY_NAME, export_case

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled import (
    delegate_support,
    onnx_attention,
    onnx_delegate,
    onnx_export,
    onnx_segments,
    onnx_shapes,
)
from asyncgraph.compiled.onnx_delegate import OnnxDelegate
from asyncgraph.runtime.config import usable_cpus

pytestmark = pytest.mark.usefixtures("leak_check")

ONNX = ExecutorConfig(segments=("onnx",))
CONFIGS = {
    "onnx": ONNX,
    "onnx, parallel": ExecutorConfig(segments=("onnx",), max_parallel_ops=2, heavy_op_flops=0,
                                     ready_order_seed=7),
}


@pytest.fixture(autouse=True)
def inline_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions and checks on the calling thread: a signature's second call runs ONNX Runtime
    (tests of the builder thread turn this off), whatever its speed against the plain nodes
    (the per-segment choice has tests of its own, which set SLOWER_BY back)."""
    monkeypatch.setattr(onnx_delegate, "BUILD_INLINE", True)
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 1)
    monkeypatch.setattr(delegate_support, "SLOWER_BY", float("inf"))


@pytest.fixture
def short_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of two nodes or more, so that the small corpus models have some."""
    monkeypatch.setattr(onnx_segments, "MIN_NODES", 2)


class MLP(torch.nn.Module):
    """8 x (Linear(64, 64), ReLU): issue 40's MLP."""

    def __init__(self, width: int = 64, layers: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*(m for _ in range(layers) for m in (
            torch.nn.Linear(width, width), torch.nn.ReLU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


class Attention(torch.nn.Module):
    """Token embeddings, a post-norm GELU encoder layer (SDPA inside), a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu",
                                                      batch_first=True)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layer(self.embed(ids)).mean(dim=1))
        return out


class Untranslatable(torch.nn.Module):
    """A polygamma (no ONNX function, no decomposition) between two long runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.sigmoid(x * 1.5 + 0.25)
        x = torch.polygamma(1, x + 1)
        for _ in range(4):
            x = torch.tanh(x * 0.5 - 0.125)
        return x


class TwoSegments(torch.nn.Module):
    """Two runs of aten nodes split by a nonzero (its output's shape depends on the values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.relu(x * 2 - 1)
        idx = torch.nonzero(x > 0).float()
        for _ in range(4):
            idx = torch.sigmoid(idx * 3 + 1)
        return idx.sum(dim=0)


def _delegates(ex: Executor) -> list[OnnxDelegate]:
    return [k.fn for k in ex.kernels if isinstance(k.fn, OnnxDelegate)]


async def _settled(ex: Executor) -> OnnxDelegate:
    """The executor's first delegate, once its builder thread has done what was asked."""
    delegates = _delegates(ex)
    for delegate in delegates:
        assert await anyio.to_thread.run_sync(delegate.wait_idle, 60), "a build took > 60 s"
    return delegates[0]


# -- what the delegate promises --------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "x"), [
    (MLP(), torch.randn(1, 64)),
    (Attention(), torch.randint(0, 50, (2, 7))),
], ids=["mlp", "attention"])
async def test_results_equal_eager(model: torch.nn.Module, x: torch.Tensor) -> None:
    async with Executor(export_model(model, x), ONNX) as ex:
        assert ex.onnx == ["onnx_segment_0"]
        outs = [await ex.execute(x) for _ in range(4)]  # the first runs the plain nodes
        stats = _delegates(ex)[0].statistics()
    for out in outs:
        torch.testing.assert_close(out, eager_output(model, x))
    assert (stats["plain_calls"], stats["onnx_calls"], stats["checked"]) == (1, 3, 1)
    assert stats["refused"] == {} and stats["sessions_built"] == 1
    assert stats["fixed_shape_sessions"] == 0  # one static signature: its session is fixed


async def test_each_input_shape_is_checked_once_with_one_session() -> None:
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (2, 5)), dynamic=True),
                        ONNX) as ex:
        for batch in (2, 5, 2, 5, 1):
            x = torch.randint(0, 50, (batch, 5))
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = _delegates(ex)[0].statistics()
    assert (stats["checked"], stats["sessions_built"]) == (3, 1)
    assert (stats["plain_calls"], stats["onnx_calls"]) == (3, 2)  # a shape's first call: plain


async def _fixed_stats(batches: tuple[int, ...] = (2, 3, 2, 3, 2, 3)) -> dict[str, Any]:
    """Chain exported with a dynamic batch, run on `batches` (each equal to eager)."""
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (2, 5)), dynamic=True),
                        ONNX) as ex:
        for batch in batches:
            x = torch.randint(0, 50, (batch, 5))
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        return _delegates(ex)[0].statistics()


async def test_a_checked_shape_of_a_dynamic_segment_runs_on_a_fixed_shape_session() -> None:
    stats = await _fixed_stats()
    # each batch size: its first call plain, then the session checked and a fixed-shape
    # session made for it (inline here: BUILD_INLINE), which runs every later call
    assert (stats["checked"], stats["fixed_shape_sessions"]) == (2, 2)
    assert (stats["plain_calls"], stats["onnx_calls"], stats["fixed_calls"]) == (2, 4, 4)
    assert stats["sessions_built"] == 1  # fixed-shape sessions are counted apart


async def test_segments_with_large_weights_get_no_fixed_shape_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(onnx_delegate, "FIXED_SHAPE_MAX_WEIGHT_BYTES", 1024)  # Chain: ~4 KiB
    stats = await _fixed_stats()
    assert (stats["fixed_shape_sessions"], stats["fixed_calls"]) == (0, 0)
    assert (stats["checked"], stats["onnx_calls"]) == (2, 4)  # the general session runs them


async def test_a_fixed_shape_session_with_other_outputs_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = onnx_delegate._make_session

    def wrong_when_fixed(*args: Any) -> Any:
        session = make(*args)
        if len(args) > 4 and args[4]:  # the sizes to fix: a fixed-shape session
            run = session.run
            session.run = lambda *a: [r * 0 + 1 for r in run(*a)]
        return session

    monkeypatch.setattr(onnx_delegate, "_make_session", wrong_when_fixed)
    stats = await _fixed_stats()
    assert (stats["fixed_shape_sessions"], stats["fixed_calls"]) == (0, 0)
    assert (stats["checked"], stats["onnx_calls"], stats["refused"]) == (2, 4, {})


async def test_a_fixed_shape_session_that_fails_gives_way_to_the_general_one() -> None:
    model = Chain()
    x = torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x, dynamic=True), ONNX) as ex:
        for _ in range(2):
            await ex.execute(x)
        delegate = _delegates(ex)[0]
        session = delegate._latest
        assert session is not None and list(session.fixed) == [(x.shape,)]

        def failing(*args: Any) -> Any:
            raise RuntimeError("a fixed-shape session failing")

        session.fixed[(x.shape,)] = dataclasses.replace(session.fixed[(x.shape,)], run=failing)
        for _ in range(2):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = delegate.statistics()
    assert (x.shape,) not in session.fixed  # dropped after its failure
    assert stats["refused"] == {} and stats["onnx_calls"] == 3


async def test_a_run_the_exporter_refuses_keeps_its_plain_nodes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The op without an ONNX function stays plain, with the reason; the runs around it are
    exported on their own."""
    model, x = Untranslatable(), torch.randn(3, 4)
    ep = export_model(model, x)
    with caplog.at_level(logging.WARNING, logger="asyncgraph.onnx"):
        plan = onnx_segments.plan_onnx_segments(imported(ep).graph, min_nodes=2)
    assert len(plan.names) == 2
    (skipped,) = plan.skipped
    assert "no ONNX function for aten.polygamma.default" in skipped.reason
    assert "stay plain: torch.onnx: no ONNX function for aten.polygamma" in caplog.text
    assert [n.name for n in plan.graph.nodes if "polygamma" in n.name] == ["polygamma"]
    async with Executor(ep, ONNX) as ex:
        for _ in range(3):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        assert "polygamma" in {n.name for n in ex.graph.nodes}
        assert all(d.statistics()["onnx_calls"] == 2 for d in _delegates(ex))


async def test_a_run_whose_export_fails_stays_plain_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise onnx_segments.ExportFailed("exporter says no")

    monkeypatch.setattr(onnx_segments, "export_segment", refuse)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ep = export_model(model, x)
    plan = onnx_segments.plan_onnx_segments(imported(ep).graph)
    assert plan.names == [] and [s.reason for s in plan.skipped] == ["exporter says no"]
    async with Executor(ep, ONNX) as ex:
        assert ex.onnx == [] and not _delegates(ex)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))


async def test_outputs_that_differ_from_the_plain_nodes_keep_the_signature_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session that computes something else (a miscompile) is caught by the first call's
    check: that signature keeps running the plain nodes, and statistics say why."""
    _wrapped_sessions(monkeypatch, lambda run: lambda *a: [r * 0 + 1 for r in run(*a)])
    stats, _ = await _chain_three_times()
    assert stats["onnx_calls"] == 0 and stats["plain_calls"] == 3
    (reason,) = stats["refused"].values()
    assert reason.startswith("output 0 differs from the plain nodes' by up to")


def _wrapped_sessions(monkeypatch: pytest.MonkeyPatch,
                      wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Sessions whose `run` is `wrap(run)` (one that miscomputes, one that is slow)."""
    make = onnx_delegate._make_session

    def made(*args: Any) -> Any:
        session = make(*args)
        session.run = wrap(session.run)
        return session

    monkeypatch.setattr(onnx_delegate, "_make_session", made)


async def _chain_three_times() -> tuple[dict[str, Any], OnnxDelegate]:
    """Chain run three times on one input (each equal to eager's output): its one delegate's
    statistics, read before the Executor closes, and the delegate."""
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), ONNX) as ex:
        for _ in range(3):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        (delegate,) = _delegates(ex)
        return delegate.statistics(), delegate


def _slowed(seconds: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A `run` that first sleeps `seconds` (the GIL released, as in a run)."""
    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def slowed(*a: Any) -> Any:
            time.sleep(seconds)
            return run(*a)
        return slowed
    return wrap


async def test_a_segment_that_onnx_runtime_runs_slower_stays_plain_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choice per segment and signature: timed against the plain nodes after its check, a
    session more than SLOWER_BY times slower leaves the signature plain; `statistics()` says
    what serves it and the medians measured."""
    monkeypatch.setattr(delegate_support, "SLOWER_BY", 1.25)
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 3)
    _wrapped_sessions(monkeypatch, _slowed(0.05))  # Chain's plain nodes: well under 1 ms
    stats, delegate = await _chain_three_times()
    assert stats["onnx_calls"] == 0 and stats["plain_calls"] == 3
    (reason,) = stats["refused"].values()
    assert reason.startswith("the plain nodes ran faster: ")
    assert "(medians of 3 runs each, alternating)" in reason
    (said,) = stats["serves"].values()
    assert said == f"plain: {reason}"
    ((onnx_s, plain_s),) = delegate.timed.values()
    assert onnx_s >= 0.05 > 1.25 * plain_s


async def test_a_segment_that_onnx_runtime_runs_faster_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delegate_support, "SLOWER_BY", 1.25)
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 3)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), ONNX) as ex:
        (delegate,) = _delegates(ex)
        module_forward = delegate.module.forward

        def slow_plain(*inputs: Any) -> Any:  # the plain nodes, 50 ms slower
            time.sleep(0.05)
            return module_forward(*inputs)

        monkeypatch.setattr(delegate.module, "forward", slow_plain)
        for _ in range(3):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = delegate.statistics()
    assert stats["onnx_calls"] == 2 and not stats["refused"]
    (said,) = stats["serves"].values()
    ((onnx_s, plain_s),) = delegate.timed.values()
    assert plain_s >= 0.05 > onnx_s
    assert said == f"onnx: {onnx_s * 1e6:.0f} us against the plain nodes' {plain_s * 1e6:.0f} us"


async def _matches_eager_three_times(
    ex: Executor, model: torch.nn.Module, x: torch.Tensor
) -> OnnxDelegate:
    """Three executions of `x` (the first checks the session, the others run it), each equal
    to eager's output; the program's one delegate."""
    for _ in range(3):
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x),
                                   rtol=1e-4, atol=1e-5)
    (delegate,) = _delegates(ex)
    return delegate


@pytest.mark.parametrize("threads", [None, 1, 2])
async def test_sessions_run_with_the_intra_op_thread_count_the_user_sets(
    threads: int | None,
) -> None:
    """A session's intra-op pool is ExecutorConfig.intra_op_threads when the user sets it (as
    they would set ONNX Runtime's own), one thread when not, whatever the CPUs (each session
    spins a pool of its own); the results are the same."""
    model, x = MLP(), torch.randn(2, 64)
    config = ExecutorConfig(segments=("onnx",), intra_op_threads=threads, max_parallel_ops=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the resolved default would be 2 wherever there are 2 CPUs
    try:
        resolved = config.intra_op_threads_or_default
        async with Executor(export_model(model, x), config) as ex:
            delegate = await _matches_eager_three_times(ex, model, x)
            stats = delegate.statistics()
            session = delegate._latest
    finally:
        torch.set_num_threads(before)
    if threads is None and usable_cpus() >= 2:  # what torch kernels would get, not sessions
        assert resolved == 2
    expected = threads or 1
    assert stats["intra_op_threads"] == expected and stats["onnx_calls"] >= 1
    assert session is not None
    assert session.session.get_session_options().intra_op_num_threads == expected


class GeluMLP(torch.nn.Module):
    """Linear, GELU (exact or tanh), Linear: the FFN of a BERT layer."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.act = torch.nn.GELU(approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.act(self.up(x)))
        return out


@pytest.mark.usefixtures("short_runs")
@pytest.mark.parametrize("approximate", ["none", "tanh"])
async def test_exact_gelu_runs_as_onnx_runtimes_fused_gelu(approximate: str) -> None:
    """torchlib writes exact GELU as five nodes in an order ONNX Runtime's optimizer does not
    fuse; the export hands it over as the Gelu contrib op (with the bias before it,
    BiasGelu). The tanh form is left as it is. Either way the session's results pass the
    first call's check and match eager."""
    model, x = GeluMLP(approximate), torch.randn(2, 3, 16)
    async with Executor(export_model(model, x), ONNX) as ex:
        delegate = await _matches_eager_three_times(ex, model, x)
        stats = delegate.statistics()
    ops = [(n.domain, n.op_type) for n in onnx.load_from_string(delegate.model.model).graph.node]
    fused = {op for domain, op in ops if domain == "com.microsoft" and "Gelu" in op}
    if approximate == "none":
        assert fused and ("", "Erf") not in ops, ops
    else:
        assert not fused, ops
    assert stats["onnx_calls"] >= 1 and not stats["refused"]


@pytest.mark.usefixtures("short_runs")
async def test_batch_first_attention_at_batch_1_moves_its_layout_by_reshapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch-first encoder layer at batch 1 transposes (1, seq, hidden) to (seq, 1, hidden)
    and back: the export writes those Transposes as Reshapes (onnx_shapes.py). The session
    passes the first call's check and matches eager; without the rewrite there are more
    Transposes. (The attention block itself, which the export would make one node, is left
    as it is here.)"""
    monkeypatch.setattr(onnx_export, "attention_fused", lambda module, args: module)

    def transposes(delegate: OnnxDelegate) -> int:
        graph = onnx.load_from_string(delegate.model.model).graph
        return sum(n.op_type == "Transpose" for n in graph.node)

    model, x = Attention(), torch.randint(0, 50, (1, 8))
    ep = export_model(model, x)
    async with Executor(ep, ONNX) as ex:
        delegate = await _matches_eager_three_times(ex, model, x)
        stats = delegate.statistics()
    assert stats["onnx_calls"] >= 1 and not stats["refused"]
    monkeypatch.setattr(onnx_shapes, "reshapes_simplified", lambda proto: proto)
    monkeypatch.setattr(onnx_export, "_CACHE", type(onnx_export._CACHE)())
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", "")  # exported again, not read from disk
    async with Executor(ep, ONNX) as plain:
        assert transposes(delegate) < transposes(_delegates(plain)[0])


@pytest.mark.usefixtures("short_runs")
@pytest.mark.parametrize("fusion", ["off", "on"])
async def test_residual_layer_norms_stay_add_and_layer_normalization(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, fusion: str,
) -> None:
    """ONNX Runtime fuses a residual Add and its LayerNormalization into SkipLayerNormalization,
    whose CPU kernel ran 4-8x slower than the two: sessions run without that fusion
    (onnx_delegate.DISABLED_OPTIMIZERS), and match eager. The optimized model ONNX Runtime
    saves shows which ran ("on": the fusion let through, as ONNX Runtime's default)."""
    if fusion == "on":
        monkeypatch.setattr(onnx_delegate, "DISABLED_OPTIMIZERS", ())
    saved = tmp_path / "optimized.onnx"

    class Options(onnx_delegate.ort.SessionOptions):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.optimized_model_filepath = str(saved)

    monkeypatch.setattr(onnx_delegate.ort, "SessionOptions", Options)
    model, x = Attention(), torch.randint(0, 50, (1, 8))
    async with Executor(export_model(model, x), ONNX) as ex:
        delegate = await _matches_eager_three_times(ex, model, x)
        stats = delegate.statistics()
    assert stats["onnx_calls"] >= 1 and not stats["refused"]
    ops = {n.op_type for n in onnx.load(str(saved), load_external_data=False).graph.node}
    assert ("SkipLayerNormalization" in ops) == (fusion == "on"), ops
    assert fusion == "on" or "LayerNormalization" in ops


class Encoder(torch.nn.Module):
    """Two encoder layers (SDPA inside each), batch first or sequence first, with the masks
    `forward` is given."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.encoder(x, mask=mask, is_causal=False)
        return out


def _ops(delegate: OnnxDelegate) -> list[str]:
    return [n.op_type for n in onnx.load_from_string(delegate.model.model).graph.node]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch first", "sequence first"])
async def test_self_attention_runs_as_one_onnx_runtime_attention_node(batch_first: bool) -> None:
    """Each encoder layer's attention block (packed projection, heads, SDPA, output
    projection) is exported as one `com.microsoft.Attention` node and a MatMul
    (onnx_attention.py): no Softmax or layout moves of its own are left. Every batch size of
    the dynamic segment matches eager."""
    model = Encoder(batch_first)
    x = torch.randn(2, 6, 32) if batch_first else torch.randn(6, 2, 32)
    dynamic = {0 if batch_first else 1: torch.export.Dim("batch", min=1, max=8)}
    ep = torch.export.export(model.eval(), (x,), dynamic_shapes=(dynamic,))
    async with Executor(ep, ONNX) as ex:
        for rows in (2, 3, 1, 3):
            shape = (rows, 6, 32) if batch_first else (6, rows, 32)
            y = torch.randn(shape)
            for _ in range(2):  # a shape's first call is checked, the second runs the session
                torch.testing.assert_close(await ex.execute(y), eager_output(model, y),
                                           rtol=1e-4, atol=1e-5)
        (delegate,) = _delegates(ex)
        stats = delegate.statistics()
    ops = _ops(delegate)
    assert ops.count("Attention") == 2 and "Softmax" not in ops, ops
    assert stats["onnx_calls"] >= 4 and not stats["refused"]


async def test_masked_attention_keeps_its_nodes_and_matches_eager() -> None:
    """A block whose SDPA takes a mask is not one `Attention` node (its mask would need
    ONNX Runtime's mask formats): it is exported node by node and matches eager."""
    model, x = Encoder(True), torch.randn(2, 6, 32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6)
    async with Executor(torch.export.export(model.eval(), (x, mask)), ONNX) as ex:
        for _ in range(3):
            with torch.no_grad():
                expected = model(x, mask)
            torch.testing.assert_close(await ex.execute(x, mask), expected, rtol=1e-4,
                                       atol=1e-5)
        (delegate,) = _delegates(ex)
        stats = delegate.statistics()
    assert "Attention" not in _ops(delegate) and "Softmax" in _ops(delegate)
    assert stats["onnx_calls"] >= 1 and not stats["refused"]


def _bert(hidden: int = 32) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=2 * hidden, max_position_embeddings=64,
                                vocab_size=100)).eval()


async def test_transformers_bert_attention_runs_as_one_attention_node() -> None:
    """transformers' BERT projects query, key and value apart and gives SDPA a mask computed
    from `arange(seq) >= 0` (every position attends): the three projections are concatenated
    into one, the mask, which depends on no input's values, is dropped, and each layer's
    block is one `Attention` node. Every batch size matches eager."""
    pytest.importorskip("transformers")
    model = _bert()
    ids = torch.randint(3, 100, (2, 8))
    ep = torch.export.export(model, (ids,),
                             dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    async with Executor(ep, ONNX) as ex:
        for rows in (2, 3, 1, 3):
            x = torch.randint(3, 100, (rows, 8))
            with torch.no_grad():
                expected = model(x).last_hidden_state
            for _ in range(2):
                out = await ex.execute(x)
                torch.testing.assert_close(out["last_hidden_state"], expected, rtol=1e-4,
                                           atol=1e-5)
        (delegate,) = _delegates(ex)
        stats = delegate.statistics()
    ops = _ops(delegate)
    assert ops.count("Attention") == 2 and "Softmax" not in ops, ops
    assert stats["onnx_calls"] >= 4 and not stats["refused"]


async def test_a_padding_mask_keeps_transformers_bert_attention_node_by_node() -> None:
    """With an attention mask given (padding in the second row), SDPA's mask depends on an
    input: the block keeps its nodes, and the padded row's outputs match eager."""
    pytest.importorskip("transformers")
    model = _bert()
    ids = torch.randint(3, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    ep = torch.export.export(model, (ids,), {"attention_mask": mask})
    async with Executor(ep, ONNX) as ex:
        with torch.no_grad():
            expected = model(ids, attention_mask=mask).last_hidden_state
        for _ in range(3):
            out = await ex.execute(ids, attention_mask=mask)
            torch.testing.assert_close(out["last_hidden_state"], expected, rtol=1e-4,
                                       atol=1e-5)
        delegates = _delegates(ex)
        stats = [d.statistics() for d in delegates]
    assert delegates and not any("Attention" in _ops(d) for d in delegates)
    assert any(s["onnx_calls"] for s in stats)


async def test_an_attention_block_that_does_not_translate_is_exported_node_by_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the translation of the fused block fails (an exporter without the registry
    entry), the segment is exported again without the fusion, not left plain."""
    translated = onnx_export._translated

    def refusing(module: torch.fx.GraphModule, *args: Any) -> Any:
        if module.graph.find_nodes(op="call_function", target=onnx_attention.TARGET):
            raise onnx_export.ExportFailed("no ONNX function for asyncgraph.attention_block")
        return translated(module, *args)

    monkeypatch.setattr(onnx_export, "_translated", refusing)
    monkeypatch.setattr(onnx_export, "_CACHE", type(onnx_export._CACHE)())
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", "")
    model, x = Encoder(True), torch.randn(2, 6, 32)
    async with Executor(export_model(model, x), ONNX) as ex:
        delegate = await _matches_eager_three_times(ex, model, x)
        stats = delegate.statistics()
    assert "Attention" not in _ops(delegate) and "Softmax" in _ops(delegate)
    assert stats["onnx_calls"] >= 1 and not stats["refused"]


async def test_a_weights_swap_runs_the_new_weights() -> None:
    """Weights are baked into the session: a swap makes a second session (the first call on
    the new version runs the plain nodes meanwhile); executions get the new results."""
    model, x = MLP(), torch.randn(2, 64)
    async with Executor(export_model(model, x), ONNX) as ex:
        before = [await ex.execute(x) for _ in range(2)]
        torch.manual_seed(1)
        new = {k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()}
        ex.swap_weights(new)
        after = [await ex.execute(x) for _ in range(3)]
        await ex.aswap_weights(dict(model.state_dict()))
        back = [await ex.execute(x) for _ in range(2)]
        stats = _delegates(ex)[0].statistics()
    expected_before = eager_output(model, x)
    model.load_state_dict(new)
    for out in after:
        torch.testing.assert_close(out, eager_output(model, x))
    for out in (*before, *back):
        torch.testing.assert_close(out, expected_before)
    assert stats["sessions_built"] == 3 and stats["sessions"] == onnx_delegate.MAX_SESSIONS
    assert stats["onnx_calls"] >= 4


def _new_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.5 for k, v in model.state_dict().items()}


async def _swapped_fixed_stats(
    new: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Chain with a dynamic batch: batches 2 and 3 checked and on fixed-shape sessions, then
    `aswap_weights` (to `new`, else other random weights) and each batch three times again,
    equal to eager on the new weights; the delegate's statistics before and after the swap."""
    model = Chain()
    xs = [torch.randint(0, 50, (batch, 5)) for batch in (2, 3)]
    async with Executor(export_model(model, xs[0], dynamic=True), ONNX) as ex:
        for x in xs * 2:
            await ex.execute(x)
        delegate = await _settled(ex)
        before = delegate.statistics()
        new = _new_weights(model, 1) if new is None else new
        await ex.aswap_weights(new)
        model.load_state_dict(new)
        for x in xs * 3:
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        await _settled(ex)
        after = delegate.statistics()
    return before, after


async def test_a_weights_swap_builds_the_fixed_shape_sessions_again() -> None:
    """Fixed-shape sessions hold one weights version's weights. After a swap the shapes that
    had them get them again on the new weights (each checked against the plain nodes on the
    new weights), and run every call after the new version's first."""
    before, after = await _swapped_fixed_stats()
    assert (before["fixed_shape_sessions"], after["fixed_shape_sessions"]) == (2, 2)
    # after the swap: the first call plain (the new version's session is built meanwhile,
    # inline here, and the fixed-shape sessions after it), then all five on fixed shapes
    assert after["plain_calls"] - before["plain_calls"] == 1
    assert after["fixed_calls"] - before["fixed_calls"] == 5
    assert (before["fixed_shape_sessions_built"], after["fixed_shape_sessions_built"]) == (2, 4)
    assert after["sessions_built"] == 2 and after["refused"] == {}


async def test_a_fixed_shape_session_wrong_on_the_new_weights_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check of a rebuilt fixed-shape session runs the plain nodes on the new weights:
    one whose outputs differ from theirs is never used, and the general session answers."""
    new = _new_weights(Chain(), 1)
    make = onnx_delegate._make_session

    def wrong_on_new_weights(*args: Any) -> Any:
        session = make(*args)
        fixed, weights = len(args) > 4 and args[4], args[2]
        if fixed and any(w is v for w in weights for v in new.values()):
            run = session.run
            session.run = lambda *a: [r + 1 for r in run(*a)]
        return session

    monkeypatch.setattr(onnx_delegate, "_make_session", wrong_on_new_weights)
    before, after = await _swapped_fixed_stats(new)
    assert (before["fixed_shape_sessions"], after["fixed_shape_sessions"]) == (2, 0)
    assert after["fixed_calls"] == before["fixed_calls"] and after["refused"] == {}
    assert after["onnx_calls"] - before["onnx_calls"] == 5
    assert after["fixed_shape_sessions_built"] == 2  # the two wrong ones were never kept


async def test_a_weight_the_onnx_model_does_not_read_is_not_handed_to_the_session() -> None:
    """onnxscript's optimizer folds `zeros_like(w)` of a static weight into a constant, so no
    node of the model reads `w`: it gets no initializer and the session is not given it (ONNX
    Runtime refuses an external initializer the model lacks)."""

    class ShapeOfWeight(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.relu(x + torch.zeros_like(w)),)

    module = torch.fx.symbolic_trace(ShapeOfWeight())
    model = onnx_export.export_segment(module, [
        onnx_export.InputSpec(torch.float32, (2, 3), (2, 3), baked=False),
        onnx_export.InputSpec(torch.float32, (2, 3), (2, 3), baked=True)])
    delegate = OnnxDelegate("onnx_segment_0", module, model, ["zeros_like", "add", "relu"],
                            static=True, weight_names=["w"])
    x, w = torch.randn(2, 3), torch.randn(2, 3)
    for _ in range(2):  # the first call plain, its session made and checked inline
        torch.testing.assert_close(delegate(x, w), [torch.relu(x)])
    stats = delegate.statistics()
    assert stats["unbuildable"] == "" and stats["refused"] == {}
    assert (stats["plain_calls"], stats["onnx_calls"]) == (1, 1)
    assert model.unread == ("w",)


async def test_a_failing_call_names_the_aten_node_that_failed() -> None:
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (3, 5)), dynamic=True),
                        ONNX) as ex:
        await ex.execute(torch.randint(0, 50, (3, 5)))  # (3, 5) checked: ONNX Runtime next
        for shape in ((2, 5), (3, 5)):  # a signature's first (plain) call, then a checked one
            with pytest.raises(IndexError, match="index out of range") as caught:
                await ex.execute(torch.full(shape, 99))  # ids past the embedding's 50 rows
            notes = "\n".join(getattr(caught.value, "__notes__", []))
            assert "%embedding = aten.embedding" in notes, notes
            assert "onnx_segment_0" in notes, notes
        x = torch.zeros(3, 5, dtype=torch.long)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = _delegates(ex)[0].statistics()
    assert stats["checked"] == 1 and stats["refused"] == {}
    assert stats["onnx_calls"] == 1  # the call after the failure: still ONNX Runtime


async def test_a_cancelled_execution_ends_after_the_segment_running() -> None:
    """The segment runs on a worker; cancelling the execution meanwhile lets it finish (ONNX
    Runtime cannot be interrupted) and stops before the next segment."""
    model, x = TwoSegments(), torch.randn(4, 6)
    config = ExecutorConfig(segments=("onnx",), max_parallel_ops=2, heavy_op_flops=0,
                            adaptive_placement=False)
    async with Executor(export_model(model, x), config) as ex:
        await ex.execute(x)
        await ex.execute(x)  # both segments checked: ONNX Runtime from now on
        first, second = _delegates(ex)
        started, release, finished = threading.Event(), threading.Event(), threading.Event()
        session = first._latest
        assert session is not None
        run = session.run

        def slow_run(*args: Any) -> Any:
            started.set()
            assert release.wait(60)
            out = run(*args)
            finished.set()
            return out

        session.run = slow_run
        second_calls = second.statistics()["calls"]
        task = asyncio.ensure_future(ex.execute(x))
        assert await anyio.to_thread.run_sync(started.wait, 60)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # the segment still runs on its worker
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()
        assert second.statistics()["calls"] == second_calls  # the next segment never ran
        session.run = run
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        assert ex.statistics().cancelled == 1


async def test_a_new_shape_is_checked_off_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without BUILD_INLINE the session and the check are made on the builder thread, on
    copies of the inputs, while the plain nodes answer; aclose waits for it."""
    monkeypatch.setattr(onnx_delegate, "BUILD_INLINE", False)
    release, threads = threading.Event(), []
    make = onnx_delegate._make_session

    def slow_make(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return make(*args)

    monkeypatch.setattr(onnx_delegate, "_make_session", slow_make)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), ONNX) as ex:
        x_used = x.clone()
        torch.testing.assert_close(await ex.execute(x_used), eager_output(model, x))
        x_used.fill_(99)  # past the embedding: a check on the caller's tensor would fail
        for _ in range(2):  # the session is held: the plain nodes run these
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        delegate = _delegates(ex)[0]
        assert delegate.statistics()["pending"] == 2  # the session, the check
        release.set()
        await _settled(ex)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = delegate.statistics()
    assert threads == ["asyncgraph-onnx-onnx_segment_0"]
    assert (stats["checked"], stats["refused"], stats["pending"]) == (1, {}, 0)
    assert (stats["plain_calls"], stats["onnx_calls"]) == (3, 1)


async def test_aclose_waits_for_the_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leak check after it fails if a builder thread outlives the Executor."""
    monkeypatch.setattr(onnx_delegate, "BUILD_INLINE", False)
    started, release = threading.Event(), threading.Event()
    make = onnx_delegate._make_session

    def slow_make(*args: Any) -> Any:
        started.set()
        assert release.wait(60)
        return make(*args)

    monkeypatch.setattr(onnx_delegate, "_make_session", slow_make)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ex = Executor(export_model(model, x), ONNX)
    await ex.execute(x)
    assert await anyio.to_thread.run_sync(started.wait, 60)
    asyncio.get_running_loop().call_later(0.05, release.set)
    await ex.aclose()
    assert release.is_set() and _delegates(ex)[0].wait_idle(0)


async def test_off_by_default_and_short_runs_stay_plain() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ep = export_model(model, x)
    async with Executor(ep) as plain:
        assert plain.onnx == [] and not _delegates(plain)
    graph, names = onnx_segments.onnx_segments(imported(ep).graph, min_nodes=10_000)
    assert names == [] and len(graph.nodes) == len(imported(ep).graph.nodes)


@pytest.mark.parametrize("missing", ["onnxruntime", "onnxscript"])
async def test_without_the_extra_the_error_names_it(
    missing: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)
    for module in ("onnx_segments", "onnx_delegate", "onnx_export"):
        monkeypatch.delitem(sys.modules, f"asyncgraph.compiled.{module}")
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    with pytest.raises(ImportError, match=rf"\({missing} is missing\): "
                                          r"pip install 'asyncgraph\[onnxruntime\]'"):
        Executor(export_model(model, x), ONNX)


# -- the conformance corpus -----------------------------------------------------------------------


def _exported(name: str, decomposed: bool) -> Any:
    case = CASES_BY_NAME[name]
    return cached_export(("model", name, decomposed),
                         lambda: export_case(case, decomposed=decomposed))


_EXPORTABLE = [c for c in CASES if c.skip is None
               and (c.export_limit is None or not c.export_limit.applies())]
# The corpus models whose graphs get ONNX segments of 2+ nodes, as exported (the decomposed
# graph of grad_and_autocast gets one too). The others run the plain graph either way, which
# tests/conformance already checks.
_ONNX = ("while_counter", "associative_scan", "vmap", "counter_buffer", "input_mutation",
         "batchnorm_train", "symbolic_arithmetic", "unbacked_item", "aliased_outputs",
         "nested_pytrees", "parameter_output", "effects_interleaved", "guard_multiple_of",
         "guard_derived_dims", "guard_runtime_assert", "channels_last",
         "keywords_and_defaults", "constants_and_sharing", "auto_dims", "transformer_encoder",
         "transformer_decoder", "convnet_bn_eval", "embedding_bag", "lstm", "gru",
         "torchbind_methods", "torchbind_ops", "sparse_input")


# Where the first call's check refuses ONNX Runtime (other outputs than the plain nodes', or
# inputs it cannot take): the delegate keeps running the plain nodes for that signature, and
# the case still conforms.
_REFUSED = {"batchnorm_train": "the exported training batch norm updates the running stats "
                               "otherwise than aten's (output 1 differs by ~0.01)",
            "sparse_input": "a sparse COO input, which numpy cannot view"}
# Decomposed, its run does not export (torch.export: `_to_dense` has no meta kernel), so the
# graph keeps its plain nodes: tests/conformance covers it.
_NOT_DECOMPOSED = ("sparse_input",)


def _ran_onnx(name: str) -> Any:
    def check(ex: Executor) -> None:
        assert ex.onnx, "no ONNX segment: the corpus test checks nothing of ONNX Runtime here"
        stats = [d.statistics() for d in _delegates(ex)]
        assert all(s["onnx_calls"] or s["refused"] for s in stats), stats
        if name in _REFUSED:
            assert any(s["refused"] for s in stats), stats
        else:
            assert any(s["onnx_calls"] for s in stats), stats

    return check


_CORPUS = [
    *((name, False) for name in _ONNX if name in CASES_BY_NAME),
    *((c.name, True) for c in _EXPORTABLE if c.decompose and c.name not in _NOT_DECOMPOSED
      and c.name in (*_ONNX, "grad_and_autocast")),
]
# `make test` runs an evenly spread part of the corpus (an export and a session per case, ~5 s
# each); the full soak leg (`make soak`) runs every case.
_SPREAD = set(_CORPUS[:: max(1, len(_CORPUS) // 8)])
_REST = full_soak_only("the rest of the ONNX corpus")


@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize(("name", "decomposed"), [
    case if case in _SPREAD else pytest.param(*case, marks=_REST) for case in _CORPUS
])
async def test_the_conformance_corpus_conforms_with_onnx_segments(
    name: str, decomposed: bool, short_runs: None
) -> None:
    if name not in {c.name for c in _EXPORTABLE}:
        pytest.skip(f"{name} does not export on this torch")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*were assigned during export.*")
        ep = _exported(name, decomposed)
    outcome = await assert_conforms(ep, CASES_BY_NAME[name].calls(), configs=CONFIGS,
                                    check=_ran_onnx(name))
    assert outcome.both_raised == 0
