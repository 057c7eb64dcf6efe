"""onnx_shapes.reshapes_simplified on small hand-built models: which layout moves become
Reshapes, which Reshape chains fold, and that ONNX Runtime's results do not change."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="ONNX segments need the asyncgraph[onnxruntime] extra")
onnx = pytest.importorskip("onnx", reason="ONNX segments need the asyncgraph[onnxruntime] extra")

import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from asyncgraph.compiled.onnx_shapes import reshapes_simplified  # noqa: E402

F = TensorProto.FLOAT


def _info(name: str, shape: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, F, shape)


def _model(nodes: list[Any], x: list[Any], out: list[Any], values: dict[str, list[Any]],
           initializers: tuple[Any, ...] | list[Any] = (),
           outputs: tuple[str, ...] = ("y",)) -> Any:
    graph = helper.make_graph(
        nodes, "g", [_info("x", x)], [_info(o, out if o == "y" else values[o]) for o in outputs],
        initializer=list(initializers), value_info=[_info(k, v) for k, v in values.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ops(model: Any) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _run(model: Any, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(None, {"x": x}))


def _same_results(before: Any, after: Any, x: np.ndarray) -> None:
    for a, b in zip(_run(before, x), _run(after, x), strict=True):
        np.testing.assert_array_equal(a, b)


def _simplified(model: Any) -> Any:
    copy = type(model).FromString(model.SerializeToString())
    return reshapes_simplified(copy)


def test_a_transpose_that_moves_only_a_size_1_dim_becomes_a_reshape_and_folds() -> None:
    """(1, 16, 8) -> (16, 1, 8), then a Reshape to (16, 8): one Reshape of x; the
    Transpose that swaps real dimensions after it stays."""
    model = _model([
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0]),
    ], [1, 16, 8], [8, 16], {"t": [16, 1, 8], "r": [16, 8]},
        [numpy_helper.from_array(np.array([16, 8], np.int64), "shape")])
    after = _simplified(model)
    assert _ops(after) == ["Reshape", "Transpose"]
    assert after.graph.node[0].input[0] == "x"
    _same_results(model, after, np.random.default_rng(0).standard_normal((1, 16, 8), np.float32))


def test_squeeze_and_unsqueeze_become_reshapes() -> None:
    model = _model([
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
        helper.make_node("Relu", ["u"], ["a"]),
        helper.make_node("Squeeze", ["a", "axes"], ["y"]),
    ], [4, 8], [4, 8], {"u": [1, 4, 8], "a": [1, 4, 8]},
        [numpy_helper.from_array(np.array([0], np.int64), "axes")])
    after = _simplified(model)
    assert _ops(after) == ["Reshape", "Relu", "Reshape"]
    _same_results(model, after, np.random.default_rng(1).standard_normal((4, 8), np.float32))


def _left_alone(case: str) -> Any:
    shape = numpy_helper.from_array(np.array([16, 8], np.int64), "shape")
    transpose = helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 2])
    chain = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["y"])]
    if case == "real dims":
        return _model([transpose], [2, 16, 8], [16, 2, 8], {})
    if case == "symbolic dim":
        return _model([transpose], ["batch", 16, 8], [16, "batch", 8], {})
    if case == "initializer":
        return _model([helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
                       helper.make_node("Add", ["x", "wt"], ["y"])], [8, 1], [8, 1],
                      {"wt": [8, 1]}, [numpy_helper.from_array(np.ones((1, 8), np.float32), "w")])
    if case == "two readers":
        return _model([*chain, helper.make_node("Relu", ["r"], ["z"])], [1, 16, 8], [16, 8],
                      {"r": [16, 8], "z": [16, 8]}, [shape], ("y", "z"))
    return _model(chain, [1, 16, 8], [16, 8], {"r": [16, 8]}, [shape], ("y", "r"))


@pytest.mark.parametrize("case", ["real dims", "symbolic dim", "initializer", "two readers",
                                  "graph output"])
def test_what_is_left_as_it_is(case: str) -> None:
    """A transpose of dimensions larger than 1, a dimension the exporter left symbolic, a
    transposed initializer (ONNX Runtime folds those), and a Reshape chain whose middle value
    is read twice or is an output of the model keep their nodes."""
    model = _left_alone(case)
    assert _ops(_simplified(model)) == _ops(model)


def test_a_model_with_control_flow_is_left_as_it_is() -> None:
    branch = helper.make_graph([helper.make_node("Transpose", ["x"], ["b"], perm=[1, 0, 2])],
                               "branch", [], [_info("b", [16, 1, 8])])
    model = _model([
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("ReduceSum", ["t"], ["s"], keepdims=0),
        helper.make_node("Cast", ["s"], ["c"], to=TensorProto.BOOL),
        helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch),
    ], [1, 16, 8], [16, 1, 8], {"t": [16, 1, 8], "s": [], "c": []})
    assert _ops(_simplified(model)) == _ops(model)
