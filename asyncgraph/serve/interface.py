"""ModelInterface: a program's signature as the Open Inference Protocol sees it.

The protocol addresses tensors by name, with a datatype and a shape in which -1 marks a dynamic
dimension. An exported program has positional, keyword and nested inputs; this module names
them once, when a model is added to a server:

- inputs are named after their placeholders (`x`, or a keyword's own name), which torch.export
  derives from the forward() parameters; inputs fixed at export (a constant keyword, None) are
  not served: the server fills them in.
- outputs are named after their place in the returned structure: `output_0` for a single
  tensor, `output_1` for the second of a tuple, `logits` for a dict key, `output_0.1` or
  `cache.0` for nested ones.

A request is checked against this interface, dimension by dimension, before any tensor is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from asyncgraph.graph.ir import Dim, Graph, Ref, ScalarSpec, TensorSpec
from asyncgraph.serve.datatypes import DATATYPES, SCALAR_DATATYPES

_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One served input or output.

    `dims` keeps the signature's dimensions (ints, or sympy symbols and expressions) for
    validation; `shape` is the protocol's view of them, -1 where the size varies. `scalar` is
    the Python type of a non-tensor value (a symbolic int, a float flag), else None. `device`
    is where the program expects an input: the server decodes on the CPU and moves it there.
    """

    name: str
    datatype: str
    dims: tuple[Dim, ...]
    position: int
    scalar: type | None = None
    device: torch.device = _CPU

    @property
    def shape(self) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in self.dims]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape}


class ModelInterface:
    """The named inputs and outputs of one model (see the module docstring)."""

    def __init__(self, model: str, graph: Graph) -> None:
        self.model = model
        sig = graph.signature
        self.ranges: dict[sympy.Symbol, tuple[int, float]] = dict(sig.range_constraints)
        self.count = len(sig.user_inputs)
        self.fixed: dict[int, Any] = {}
        inputs: list[TensorInfo] = []
        for position, spec in enumerate(sig.user_inputs):
            value = graph.values[spec.value]
            info = _info(value.name, value.spec, position, f"{model}: input {value.name!r}")
            if info is None:
                assert isinstance(value.spec, ScalarSpec)
                self.fixed[position] = value.spec.value
            else:
                inputs.append(info)
        self.inputs = inputs
        self.inputs_by_name = {i.name: i for i in inputs}
        outputs: list[TensorInfo] = []
        names = output_names(sig.out_spec, len(sig.user_outputs))
        for position, (name, out) in enumerate(zip(names, sig.user_outputs, strict=True)):
            where = f"{model}: output {name!r}"
            if isinstance(out.arg, Ref):
                info = _info(name, graph.values[out.arg.id].spec, position, where, output=True)
            else:
                info = _constant_info(name, out.arg, position, where)
            assert info is not None
            outputs.append(info)
        self.outputs = outputs
        self.outputs_by_name = {o.name: o for o in outputs}

    def metadata(self) -> dict[str, Any]:
        """The model metadata response (GET /v2/models/{name}), without the name fields."""
        return {
            "inputs": [i.metadata() for i in self.inputs],
            "outputs": [o.metadata() for o in self.outputs],
        }


def _info(
    name: str, spec: Any, position: int, where: str, output: bool = False
) -> TensorInfo | None:
    """A served tensor or scalar, None for an input fixed at export, or a ValueError."""
    if isinstance(spec, TensorSpec):
        datatype = DATATYPES.get(spec.dtype)
        if datatype is None:
            raise ValueError(f"{where}: dtype {spec.dtype} has no protocol datatype")
        return TensorInfo(name, datatype, tuple(spec.shape), position, device=spec.device)
    if isinstance(spec, ScalarSpec):
        if spec.fixed and not output:
            return None
        datatype = SCALAR_DATATYPES.get(spec.type)
        if datatype is None:
            raise ValueError(f"{where}: a {spec.type.__name__} cannot be sent as a tensor")
        return TensorInfo(name, datatype, (), position, scalar=spec.type)
    raise ValueError(
        f"{where}: the program records no dtype and shape for it; serve a torch.export "
        "program, or give the graph value a TensorSpec"
    )


def _constant_info(name: str, value: Any, position: int, where: str) -> TensorInfo:
    datatype = SCALAR_DATATYPES.get(type(value))
    if isinstance(value, torch.Tensor):
        return TensorInfo(name, DATATYPES[value.dtype], tuple(value.shape), position)
    if datatype is None:
        raise ValueError(f"{where}: the constant {value!r} cannot be sent as a tensor")
    return TensorInfo(name, datatype, (), position, scalar=type(value))


def output_names(out_spec: pytree.TreeSpec | None, count: int) -> list[str]:
    """Protocol names for the flat user outputs, from their place in the output structure."""
    if out_spec is None or out_spec.num_leaves != count:
        return [f"output_{i}" for i in range(count)]
    tree = pytree.tree_unflatten(list(range(count)), out_spec)
    names: list[str] = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        parts = [_key_name(k) for k in path]
        if not parts:
            names.append("output_0")
        elif isinstance(path[0], pytree.SequenceKey):
            names.append("output_" + ".".join(parts))
        else:
            names.append(".".join(parts))
    if len(set(names)) != len(names):  # keys like "a.b" and ("a", "b") can collide
        return [f"output_{i}" for i in range(count)]
    return names


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def describe(info: TensorInfo) -> str:
    """`FP32 [-1, 4]`, for error messages."""
    return f"{info.datatype} {info.shape}"

