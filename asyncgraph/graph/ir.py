"""The graph IR: values with dense integer ids, nodes that call a target, and a signature.

A Graph is immutable once built and validated at construction, so everything downstream
(kernels, plan, scheduler) can trust it: every referenced value exists and is defined before
use, names are unique, targets are callable, and there is no cycle. An error names the node and
prints the graph.

Node arguments are ordinary Python structures (tuples, lists, dicts, constants) in which a
`Ref` stands for a value of the graph; the plan turns them into code once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils._pytree import TreeSpec

from asyncgraph.errors import GraphValidationError
from asyncgraph.graph.refs import Ref as Ref  # re-exported: the IR names it
from asyncgraph.graph.refs import iter_refs as iter_refs

Dim = Any  # an int, or a sympy expression over the program's symbols


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a tensor value is expected to be: dtype, device and shape (ints or symbols).

    `hint` is a concrete shape (the example the program was exported with) used to estimate
    a kernel's cost before it has ever run.
    """

    dtype: torch.dtype
    device: torch.device
    shape: tuple[Dim, ...]
    hint: tuple[int, ...]

    @property
    def numel_hint(self) -> int:
        n = 1
        for d in self.hint:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ScalarSpec:
    """A non-tensor value: its type, and its exact value when the program fixed it."""

    type: type
    value: Any = None
    fixed: bool = True
    expr: sympy.Expr | None = None


ValueSpec = TensorSpec | ScalarSpec


@dataclass(slots=True)
class Value:
    """A value of the graph: a graph input, a weight, or the result of a node."""

    id: int
    name: str
    producer: int | None = None
    spec: ValueSpec | None = None


@dataclass(slots=True)
class Node:
    """One call: `target(*args, **kwargs)`, whose result becomes value `output`."""

    index: int
    name: str
    target: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: int
    stack_trace: str | None = None
    placement_hint: str | None = None
    effects: tuple[Any, ...] = ()  # declared states it touches (GraphBuilder's `effects=`)
    after: tuple[int, ...] = ()  # set by the Graph: outputs of earlier side effects (effects.py)

    def inputs(self) -> list[int]:
        """The ids of the values this node waits for, each once: those it reads, in first-use
        order, then `after`, the outputs of the side effects it must follow."""
        seen = dict.fromkeys(self.data_inputs())
        seen.update(dict.fromkeys(self.after))
        return list(seen)

    def data_inputs(self) -> list[int]:
        """The ids of the values its arguments read, each once, in first-use order."""
        seen: dict[int, None] = {}
        for ref in iter_refs((self.args, self.kwargs)):
            seen.setdefault(ref.id, None)
        return list(seen)

    def target_name(self) -> str:
        return target_name(self.target)


class InputKind(enum.Enum):
    USER_INPUT = "user_input"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    TOKEN = "token"


class OutputKind(enum.Enum):
    USER_OUTPUT = "user_output"
    BUFFER_MUTATION = "buffer_mutation"
    USER_INPUT_MUTATION = "user_input_mutation"
    TOKEN = "token"


WEIGHT_KINDS = frozenset({InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT})


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One graph input. `target` is the weight name, or for user inputs their path in the
    user's words: the forward's parameter (`x`), a keyword's name (`mask`), into structures
    (`inputs['a'][0]`); `args[0]` / `kwargs['k']` only where no name is known."""

    kind: InputKind
    value: int
    target: str | None = None


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One graph output: a Ref or a constant. `target` names the mutated buffer or input."""

    kind: OutputKind
    arg: Any
    target: str | None = None


@dataclass(frozen=True, slots=True)
class InputGuard:
    """A condition on the user inputs that export recorded and ep.module() checks (divisible
    sizes, derived dims, specializations, `ep._guards_code`): `code` is Python over the flat
    inputs `args[i]` (as torch generates it for ep.module()), `text` the same over the user's
    argument names, for messages."""

    code: str
    text: str


@dataclass(frozen=True, slots=True)
class Signature:
    """The program's interface, as torch.export's ExportGraphSignature describes it."""

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    in_spec: TreeSpec | None = None
    out_spec: TreeSpec | None = None
    range_constraints: dict[sympy.Symbol, tuple[int, float]] = field(default_factory=dict)
    guards: tuple[InputGuard, ...] = ()
    dim_names: dict[tuple[int, int], str] = field(default_factory=dict)  # (input, dim) -> Dim
    arg_names: tuple[str, ...] = ()  # the positional parameters' names (forward's), if known

    @property
    def user_inputs(self) -> list[InputSpec]:
        return [s for s in self.inputs if s.kind is InputKind.USER_INPUT]

    @property
    def weight_inputs(self) -> list[InputSpec]:
        return [s for s in self.inputs if s.kind in WEIGHT_KINDS]

    @property
    def user_outputs(self) -> list[OutputSpec]:
        return [s for s in self.outputs if s.kind is OutputKind.USER_OUTPUT]


def spec_children(spec: TreeSpec) -> list[TreeSpec]:
    """A TreeSpec's children, across torch versions (children_specs is deprecated in 2.10+)."""
    children = getattr(spec, "children", None)
    if callable(children):
        return list(children())
    return list(spec.children_specs)


def target_name(target: Any) -> str:
    """A readable name for a node's target: aten.add.Tensor, operator.getitem, my_fn."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return repr(target)
    if module in (None, "builtins"):
        return str(name)
    return f"{module}.{name}"


class Graph:
    """A validated dataflow graph with its signature.

    Attributes:
        values: every value, indexed by its dense id.
        nodes: the nodes, in a topological order (index == position).
        signature: inputs (user inputs and weights), outputs and pytree specs.
        effect_nodes: the nodes that touch a state some node writes (effects.py); each
            node's `after` keeps them in graph order.
    """

    __slots__ = ("_by_name", "effect_nodes", "nodes", "signature", "values")

    def __init__(self, values: Sequence[Value], nodes: Sequence[Node], signature: Signature):
        self.values = list(values)
        self.nodes = list(nodes)
        self.signature = signature
        self._by_name: dict[str, Node] = {}
        self._validate()

    def node(self, name: str) -> Node:
        """The node called `name`."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the graph") from None

    def user_nodes(self) -> list[list[int]]:
        """For each node, the indices of the nodes that read its output, each once."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for vid in node.inputs():
                producer = self.values[vid].producer
                if producer is not None and node.index not in users[producer]:
                    users[producer].append(node.index)
        return users

    def format(self) -> str:
        """The graph as text, one line per input, node and output."""
        lines = ["graph("]
        for spec in self.signature.inputs:
            value = self.values[spec.value]
            extra = f" target={spec.target!r}" if spec.target else ""
            lines.append(f"    %{value.name} : {spec.kind.value}{extra}")
        lines.append("):")
        for node in self.nodes:
            args = ", ".join(
                [_format_arg(a, self.values) for a in node.args]
                + [f"{k}={_format_arg(v, self.values)}" for k, v in node.kwargs.items()]
            )
            after = ", ".join(f"%{self.values[v].name}" for v in node.after)
            lines.append(
                f"    %{self.values[node.output].name} = {node.target_name()}({args})"
                + (f"  # after {after}" if after else "")
            )
        outs = ", ".join(_format_arg(o.arg, self.values) for o in self.signature.outputs)
        lines.append(f"    return ({outs})")
        return "\n".join(lines)

    def described(self) -> str:
        """`format()`, which names no shape, with every value's spec (shapes, symbolic ones
        included, dtypes, devices) and the symbols' ranges: what is built or decided for a
        graph differs between the same model exported with a static and a dynamic batch."""
        ranges = sorted((str(s), r) for s, r in self.signature.range_constraints.items())
        return "\n".join([self.format(), *(f"{v.name}: {v.spec!r}" for v in self.values),
                          repr(ranges)])

    def __repr__(self) -> str:
        return f"<Graph: {len(self.nodes)} nodes, {len(self.values)} values>"

    # -- validation -------------------------------------------------------------------------

    def _fail(self, message: str) -> GraphValidationError:
        return GraphValidationError(f"{message}\n\n{self.format()}")

    def _validate(self) -> None:
        names: dict[str, str] = {}
        for i, value in enumerate(self.values):
            if value.id != i:
                raise self._fail(f"value %{value.name} has id {value.id}, expected {i}")
            if value.name in names:
                raise self._fail(f"duplicate name {value.name!r}")
            names[value.name] = "value"
        for position, node in enumerate(self.nodes):
            if node.index != position:
                raise self._fail(f"node %{node.name} has index {node.index}, expected {position}")
            if node.name in self._by_name:
                raise self._fail(f"duplicate node name {node.name!r}")
            self._by_name[node.name] = node
            if not callable(node.target):
                raise self._fail(
                    f"node %{node.name}: unknown op {node.target!r} (its target is not callable)"
                )
            if not 0 <= node.output < len(self.values):
                raise self._fail(f"node %{node.name}: output id {node.output} does not exist")
            if self.values[node.output].producer != node.index:
                raise self._fail(f"node %{node.name}: its output value names another producer")
        inputs = {spec.value for spec in self.signature.inputs}
        for value in self.values:
            if value.producer is None and value.id not in inputs:
                raise self._fail(f"value %{value.name} has no producer and is not a graph input")
        for node in self.nodes:
            for vid in node.inputs():
                if not 0 <= vid < len(self.values):
                    raise self._fail(
                        f"node %{node.name} ({node.target_name()}) reads value id {vid}, "
                        "which does not exist (dangling value)"
                    )
        for out in self.signature.outputs:
            for ref in iter_refs(out.arg):
                if not 0 <= ref.id < len(self.values):
                    raise self._fail(f"graph output reads value id {ref.id}, which does not exist")
        from asyncgraph.graph.effects import order_effects

        self.effect_nodes = order_effects(self.nodes)
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        """Reject a cycle (naming its nodes) and a node that reads a value defined after it."""
        users = self.user_nodes()
        counts = [0] * len(self.nodes)
        for node in self.nodes:
            producers = {self.values[v].producer for v in node.inputs()}
            producers.discard(None)
            counts[node.index] = len(producers)
        ready = [i for i, c in enumerate(counts) if c == 0]
        done = 0
        while ready:
            i = ready.pop()
            done += 1
            for u in users[i]:
                counts[u] -= 1
                if counts[u] == 0:
                    ready.append(u)
        if done != len(self.nodes):
            stuck = [self.nodes[i].name for i, c in enumerate(counts) if c > 0]
            raise self._fail(f"the graph has a cycle through nodes {', '.join(stuck)}")
        for node in self.nodes:
            for vid in node.inputs():
                producer = self.values[vid].producer
                if producer is not None and producer >= node.index:
                    raise self._fail(
                        f"node %{node.name} reads %{self.values[vid].name} before it is "
                        "defined; nodes must be listed in topological order"
                    )


def _format_arg(arg: Any, values: list[Value]) -> str:
    if isinstance(arg, Ref):
        if 0 <= arg.id < len(values):
            return f"%{values[arg.id].name}"
        return f"%<missing {arg.id}>"
    if isinstance(arg, tuple):
        inner = ", ".join(_format_arg(a, values) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(_format_arg(a, values) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v, values)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch.nn.Module):
        return f"<{type(arg).__name__}>"
    return repr(arg)
