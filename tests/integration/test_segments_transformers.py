"""Segments of a Hugging Face BertModel (transformers, random weights, two layers): its ONNX
segments and its AOTInductor segments give the eager model's outputs.

Two programs of the one model: as exported (`last_hidden_state` and `pooler_output`), and
reading `last_hidden_state` only, where torch.export keeps the pooler's linear and tanh though
nothing reads them. The exporters drop such nodes with the weights only they read: an ONNX
segment then named initializers its model lacked, and ONNX Runtime refused it ("Failed to find
existing initializer"); a compiled package listed constants its AOTI model lacked (fixed in
the compile, tests/integration/test_compiled.py's unused pooler).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncgraph
from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled import compile_program
from tests.support.transformers_zoo import ZOO, example_inputs

pytestmark = pytest.mark.usefixtures("leak_check")

COMPILED_TOL = {"rtol": 1e-5, "atol": 1e-5}  # test_compiled.py's; ONNX: assert_close's own


class LastHiddenState(torch.nn.Module):
    """The BertModel, its last hidden state only: the pooler's nodes are dead code."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bert(ids, attention_mask=attention_mask).last_hidden_state
        return out


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return ZOO["bert"]().eval()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with padding in the second row (so the mask matters)."""
    (ids,), kwargs = example_inputs(seed)
    return ids, kwargs["attention_mask"]


class Programs:
    """The model and its two programs (exported once for the module)."""

    def __init__(self) -> None:
        self.bert = _bert()
        self.last_hidden = LastHiddenState(self.bert).eval()
        ids, mask = _inputs(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' and torch's tracing warnings
            self.outputs = torch.export.export(self.bert, (ids,), {"attention_mask": mask})
            self.dead_pooler = torch.export.export(self.last_hidden, (ids,),
                                                   {"attention_mask": mask})

    def eager(self, program: str, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        module = self.bert if program == "outputs" else self.last_hidden
        with torch.no_grad():
            return module(ids, attention_mask=mask)


@pytest.fixture(scope="module")
def programs() -> Programs:
    return Programs()


def _assert_close(program: str, actual: Any, expected: Any, **tolerance: Any) -> None:
    if program == "outputs":
        for name in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(getattr(actual, name), getattr(expected, name),
                                       **tolerance)
    else:
        torch.testing.assert_close(actual, expected, **tolerance)


def _delegates(ex: Executor) -> list[Any]:
    from asyncgraph.compiled.onnx_delegate import OnnxDelegate

    return [k.fn for k in ex.kernels if isinstance(k.fn, OnnxDelegate)]


def _pooler_nodes(ex: Executor) -> list[str]:
    """The pooler's tanh among the nodes that run: plain nodes and the ONNX segments'."""
    names = [n.name for n in ex.graph.nodes]
    names += [name for d in _delegates(ex) for name in d.node_names]
    return [name for name in names if name.startswith("tanh")]


# -- ONNX segments ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("program", ["outputs", "dead_pooler"])
async def test_onnx_segments_of_a_bert_model_match_eager(
    programs: Programs, program: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every segment's session is made and checked (inline: BUILD_INLINE), and the calls after
    the first run ONNX Runtime with the eager model's results."""
    for extra in ("onnxruntime", "onnxscript"):
        pytest.importorskip(extra, reason="ONNX segments need the asyncgraph[onnxruntime] extra")
    from asyncgraph.compiled import onnx_delegate

    monkeypatch.setattr(onnx_delegate, "BUILD_INLINE", True)
    async with Executor(getattr(programs, program),
                        ExecutorConfig(segments=("onnx",))) as ex:
        assert ex.onnx
        for seed in (1, 1, 2):
            ids, mask = _inputs(seed)
            _assert_close(program, await ex.execute(ids, attention_mask=mask),
                          programs.eager(program, ids, mask))
        stats = [d.statistics() for d in _delegates(ex)]
        pooler = _pooler_nodes(ex)
    for s in stats:
        assert s["unbuildable"] == "" and s["refused"] == {}, s
        assert s["onnx_calls"] == 2 and s["sessions_built"] == 1, s
    if program == "dead_pooler":
        assert pooler == [], f"the unread pooler's nodes still run: {pooler}"


# -- AOTInductor segments ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_aoti_package(programs: Programs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile (~10-30 s): the program whose pooler is dead code, the case that broke both
    delegates."""
    path = tmp_path_factory.mktemp("aoti-transformers") / "bert.aoti.pt2"
    report = compile_program(programs.dead_pooler, path, "auto")
    assert report.segments and not report.failed, report.failed
    return path


@pytest.mark.timeout(900)  # the module's compile is paid by this test (conftest's HEAVY_FIXTURES)
@pytest.mark.xdist_group("aoti")  # with test_compiled.py's compiles, on one xdist worker
@pytest.mark.asyncio(loop_factories=["asyncio"])  # one compile: the loop is not the point
async def test_aotinductor_segments_of_a_bert_model_match_eager(
    programs: Programs, bert_aoti_package: Path,
) -> None:
    async with asyncgraph.load(bert_aoti_package, trust_compiled=True) as ex:
        assert any(n.name.startswith("aoti_segment_") for n in ex.graph.nodes)
        for seed in (1, 2):
            ids, mask = _inputs(seed)
            _assert_close("dead_pooler", await ex.execute(ids, attention_mask=mask),
                          programs.eager("dead_pooler", ids, mask), **COMPILED_TOL)
        assert _pooler_nodes(ex) == []
