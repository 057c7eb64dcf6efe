"""Turn what users have into a Program (a Graph plus its weights).

Accepted: a torch.export.ExportedProgram, a .pt2 file written by torch.export.save, a
torch.fx.GraphModule, a Graph made with GraphBuilder, or a Program. Exported programs that
mutate buffers or inputs in place are functionalized first (run_decompositions with an empty
table), so mutations appear in the signature and never touch shared weights during a run; so are
programs that call effectful ops (so effect tokens order them) and pre-dispatch programs whose
nodes change thread-local state (torch.vmap levels, grad mode).
"""

from __future__ import annotations

import ast
import inspect
import os
import warnings
import weakref
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind as TorchInputKind
from torch.export.graph_signature import OutputKind as TorchOutputKind
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

from asyncgraph.errors import GraphValidationError, ProgramLoadError
from asyncgraph.graph import dim_names
from asyncgraph.graph.archive import (
    TRUST_HINT,
    check_pt2_archive,
    existing_file,
    is_compiled_package,
)
from asyncgraph.graph.ir import (
    Graph,
    InputGuard,
    InputKind,
    InputSpec,
    Node,
    OutputKind,
    OutputSpec,
    Ref,
    ScalarSpec,
    Signature,
    TensorSpec,
    Value,
    ValueSpec,
    spec_children,
)


@dataclass(frozen=True)
class Program:
    """A validated Graph with the weights it reads, ready for an Executor.

    `reference` is a callable with the user's calling convention (ep.module() for exported
    programs) used by `asyncgraph check` and the tests; it may be None.
    """

    graph: Graph
    weights: dict[str, Any] = field(default_factory=dict)
    name: str = "program"
    reference: Callable[..., Any] | None = None
    exported: ExportedProgram | None = None


ProgramLike = ExportedProgram | torch.fx.GraphModule | Graph | Program | str | os.PathLike[str]


def to_program(source: ProgramLike) -> Program:
    """Import any supported program source."""
    if isinstance(source, Program):
        return source
    if isinstance(source, Graph):
        return Program(source, {}, name="graph")
    if isinstance(source, ExportedProgram):
        return from_exported_program(source)
    if isinstance(source, torch.fx.GraphModule):
        return from_graph_module(source)
    if isinstance(source, (str, os.PathLike)):
        return load_pt2(source)
    raise TypeError(
        "expected an ExportedProgram, a .pt2 path, a torch.fx.GraphModule, a Graph or a "
        f"Program, got {type(source).__name__}"
    )


def load_pt2(path: str | os.PathLike[str]) -> Program:
    """Load a plain .pt2 written by torch.export.save, refusing anything that is not one.

    A compiled package (`asyncgraph compile`) loads native code: graph/ never reads one, so it
    is refused here; asyncgraph.load (asyncgraph/loading.py) loads it when trusted.
    """
    p = open_pt2(path)
    if is_compiled_package(p):
        raise ProgramLoadError(
            f"{p}: an AOTInductor-compiled package (asyncgraph compile), which holds "
            f"native code that runs when loaded; {TRUST_HINT}"
        )
    return read_plain_pt2(p)


def open_pt2(path: str | os.PathLike[str]) -> Path:
    """The path of an existing, uncorrupted zip archive (a .pt2 of either kind)."""
    p = existing_file(path)
    if not zipfile.is_zipfile(p):
        raise ProgramLoadError(f"{p}: not a .pt2 archive (not a zip file)")
    try:
        with zipfile.ZipFile(p) as archive:
            bad = archive.testzip()
        if bad is not None:
            raise ProgramLoadError(f"{p}: archive member {bad!r} is corrupt")
    except zipfile.BadZipFile as exc:
        raise ProgramLoadError(f"{p}: truncated or corrupt archive ({exc})") from None
    return p


def read_plain_pt2(p: Path) -> Program:
    """A plain .pt2 checked by open_pt2, checked again member by member, then imported."""
    check_pt2_archive(p, verify_crc=False)  # nothing from the file runs (see graph/archive/)
    try:
        with warnings.catch_warnings():
            # torch 2.10-2.11 build weights with torch.frombuffer over the archive's bytes and
            # warn that the buffer is read-only. asyncgraph never writes to weights in place (a
            # mutation makes a new Weights version), and tests and services that turn
            # warnings into errors must still load a .pt2.
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            ep = torch.export.load(p)
    except ProgramLoadError:
        raise
    except Exception as exc:
        raise ProgramLoadError(f"{p}: cannot load the exported program: {exc}") from exc
    program = from_exported_program(ep)
    names = program.graph.signature.dim_names
    for key, name in dim_names.read(p).items():  # what asyncgraph.save kept of the Dims
        names.setdefault(key, name)
    return Program(program.graph, program.weights, p.name, program.reference, ep)


# ExportedProgram -> its functionalized form: run_decompositions takes 0.3-1 s, and services
# and tests build several Executors from one program
_FUNCTIONALIZED: weakref.WeakKeyDictionary[ExportedProgram, ExportedProgram] = (
    weakref.WeakKeyDictionary()
)


def from_exported_program(ep: ExportedProgram) -> Program:
    """Import an ExportedProgram, functionalizing it first when it mutates in place."""
    if _has_mutating_ops(ep.graph_module) or _has_global_state_calls(ep.graph_module):
        functional = _FUNCTIONALIZED.get(ep)
        if functional is None:
            functional = _FUNCTIONALIZED[ep] = ep.run_decompositions({})
        ep = functional
    gm = ep.graph_module
    sig = ep.graph_signature
    builder = _FxImporter(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise GraphValidationError(
            f"exported program has {len(placeholders)} placeholders but its signature lists "
            f"{len(sig.input_specs)} inputs"
        )
    weights: dict[str, Any] = {}
    reference = ep.module()
    arg_names = _positional_names(_export_arg_names(ep, reference), ep.call_spec.in_spec)
    user_paths = iter(_user_input_paths(ep.call_spec.in_spec, len(sig.user_inputs), arg_names))
    inputs: list[InputSpec] = []
    for fx_node, ispec in zip(placeholders, sig.input_specs, strict=True):
        vid = builder.add_placeholder(fx_node)
        kind = _INPUT_KINDS.get(ispec.kind)
        if kind is None:
            raise GraphValidationError(
                f"input %{fx_node.name}: input kind {ispec.kind.name} is not supported"
            )
        if kind is InputKind.USER_INPUT:
            inputs.append(InputSpec(kind, vid, next(user_paths)))
        elif kind is InputKind.TOKEN:
            inputs.append(InputSpec(kind, vid, fx_node.name))
        else:
            name = ispec.target
            assert name is not None
            weights[name] = _lookup_weight(ep, name)
            inputs.append(InputSpec(kind, vid, name))
    builder.add_calls()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    if len(out_args) != len(sig.output_specs):
        raise GraphValidationError(
            f"exported program returns {len(out_args)} values but its signature lists "
            f"{len(sig.output_specs)} outputs"
        )
    outputs: list[OutputSpec] = []
    for arg, ospec in zip(out_args, sig.output_specs, strict=True):
        okind = _OUTPUT_KINDS.get(ospec.kind)
        if okind is None:
            raise GraphValidationError(f"output kind {ospec.kind.name} is not supported")
        target = ospec.target
        if okind is OutputKind.USER_INPUT_MUTATION:
            target = _mutated_input_path(ep, inputs, builder, ospec.target)
        outputs.append(OutputSpec(okind, builder.convert(arg), target))
    for out in outputs:  # we never write weights in place, but ep.module() does: don't share
        if out.kind is OutputKind.BUFFER_MUTATION and out.target in weights:
            weights[out.target] = weights[out.target].clone()
    ranges = {
        sym: (_lower(vr.lower), _upper(vr.upper)) for sym, vr in ep.range_constraints.items()
    }
    guards, dim_names = _input_guards(ep, reference)
    signature = Signature(
        tuple(inputs), tuple(outputs), ep.call_spec.in_spec, ep.call_spec.out_spec, ranges,
        guards, dim_names, arg_names,
    )
    graph = Graph(builder.values, builder.nodes, signature)
    return Program(graph, weights, name="exported_program", reference=reference, exported=ep)


def _input_guards(
    ep: ExportedProgram, module: torch.nn.Module
) -> tuple[tuple[InputGuard, ...], dict[tuple[int, int], str]]:
    """The guards ep.module() checks on its inputs, made as torch makes its `_guards_fn`
    (torch.export._unlift), and the user's names of the dims (`Dim("batch")`), where the
    program still has its shape environment.

    Without them a program specialised on, say, an even size silently runs the branch it was
    traced with on an odd one. Guard code from a .pt2 was checked by graph/archive/ (plain
    arithmetic over input sizes) before torch loaded it; ep.module() already compiled it.
    """
    try:
        from torch.export import _unlift

        graph: Any = module.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        if not placeholders or not ep.example_inputs:
            return (), {}
        sig = inspect.signature(module.forward)
        paths = _unlift._get_input_paths(ep.example_inputs, sig)  # type: ignore[no-untyped-call]
        code = list(_unlift._get_input_guards_for_graph(
            placeholders, ep.range_constraints, paths
        ))
        recorded = _unlift._force_ep_signature_match(getattr(ep, "_guards_code", []), paths)
        code += _unlift._force_gm_signature_match(recorded, sig)
        sources = ["L" + pytree.keystr(path) for path in paths]
        texts = [str(path[0].key) + pytree.keystr(path[1:]) for path in paths]
    except Exception:  # private helpers another torch may lack or change
        return (), {}  # then ranges and equal dims are still checked, as before
    order = sorted(range(len(paths)), key=lambda i: -len(sources[i]))  # L['x'][0] before L['x']

    def rewrite(guard: str, names: list[str]) -> str:
        for i in order:
            guard = guard.replace(sources[i], names[i])
        return guard

    flat = [f"args[{i}]" for i in range(len(paths))]
    guards = tuple(dict.fromkeys(
        InputGuard(rewrite(c, flat), _readable(rewrite(c, texts))) for c in code
    ))
    return guards, _dim_names(ep, sources)


def _readable(guard: str) -> str:
    """A guard as ep.module()'s message words it: one line, without redundant parentheses."""
    try:
        return ast.unparse(ast.parse(guard.replace("\n", " "), mode="eval"))
    except SyntaxError:
        return guard.replace("\n", " ")


def _dim_names(ep: ExportedProgram, sources: list[str]) -> dict[tuple[int, int], str]:
    """(input, dim) -> the name the user gave that dim, from the shape environment export
    left on the placeholders' fake tensors (a loaded .pt2 has none)."""
    names: dict[str, str] = {}
    for node in ep.graph_module.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        for d in getattr(val, "shape", ()):
            if isinstance(d, torch.SymInt):
                names = getattr(d.node.shape_env, "source_name_to_debug_name", None) or {}
                break
        if names:
            break
    found: dict[tuple[int, int], str] = {}
    for source, name in names.items():
        for i, base in enumerate(sources):
            prefix = base + ".size()["
            if source.startswith(prefix) and source.endswith("]"):
                dim = source[len(prefix):-1]
                if dim.isdigit():
                    found[(i, int(dim))] = str(name)
    return found


def from_graph_module(gm: torch.fx.GraphModule) -> Program:
    """Import an fx GraphModule (symbolic_trace or make_fx output)."""
    builder = _FxImporter(gm)
    inputs: list[InputSpec] = []
    weights: dict[str, Any] = {}
    params = dict(gm.named_parameters())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = _fx_in_spec(gm)
    arg_names: tuple[str, ...] = ()
    if in_spec is None:  # forward(x, y): the placeholders are the parameters
        paths = [str(n.target).lstrip("*") for n in placeholders]
    else:  # forward(*args) that flattens its arguments by the input spec
        info = getattr(gm.graph._codegen, "pytree_info", None)
        arg_names = _positional_names(list(getattr(info, "orig_args", None) or ()), in_spec)
        paths = _user_input_paths(in_spec, len(placeholders), arg_names)
    for fx_node, path in zip(placeholders, paths, strict=True):
        inputs.append(InputSpec(InputKind.USER_INPUT, builder.add_placeholder(fx_node), path))
    for fx_node in gm.graph.nodes:
        if fx_node.op != "get_attr":
            continue
        obj = _get_attr(gm, str(fx_node.target))
        if isinstance(obj, torch.Tensor):
            vid = builder.add_placeholder(fx_node, spec=_spec_of(obj))
            kind = InputKind.PARAMETER if fx_node.target in params else InputKind.BUFFER
            weights[str(fx_node.target)] = obj
            inputs.append(InputSpec(kind, vid, str(fx_node.target)))
    builder.add_calls()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, out_spec = pytree.tree_flatten(out_node.args[0])
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, builder.convert(a)) for a in leaves]
    signature = Signature(tuple(inputs), tuple(outputs), in_spec, out_spec, arg_names=arg_names)
    graph = Graph(builder.values, builder.nodes, signature)
    return Program(graph, weights, name=type(gm).__name__, reference=gm)


class CallMethod:
    """The target of an fx call_method node: `args[0].<name>(*args[1:], **kwargs)`."""

    __slots__ = ("__name__", "method")

    def __init__(self, method: str) -> None:
        self.method = method
        self.__name__ = f"call_method.{method}"

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.method)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CallMethod({self.method!r})"


class _FxImporter:
    """Walks an fx graph, giving every placeholder and call a dense value id."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.ids: dict[torch.fx.Node, int] = {}
        self.constants: dict[torch.fx.Node, Any] = {}

    def add_placeholder(self, fx_node: torch.fx.Node, spec: ValueSpec | None = None) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, fx_node.name, None, spec or _meta_spec(fx_node)))
        self.ids[fx_node] = vid
        return vid

    def add_calls(self) -> None:
        for fx_node in self.gm.graph.nodes:
            if fx_node.op == "get_attr" and fx_node not in self.ids:
                self.constants[fx_node] = _get_attr(self.gm, str(fx_node.target))
            elif fx_node.op in ("call_function", "call_method", "call_module"):
                self._add_call(fx_node)
            elif fx_node.op not in ("placeholder", "get_attr", "output"):
                raise GraphValidationError(f"node %{fx_node.name}: unknown fx op {fx_node.op!r}")

    def _add_call(self, fx_node: torch.fx.Node) -> None:
        target: Any = fx_node.target
        if fx_node.op == "call_method":
            target = CallMethod(str(target))
        elif fx_node.op == "call_module":
            target = _get_attr(self.gm, str(target))
        vid = len(self.values)
        index = len(self.nodes)
        self.values.append(Value(vid, fx_node.name, index, _meta_spec(fx_node)))
        self.ids[fx_node] = vid
        self.nodes.append(
            Node(
                index=index,
                name=fx_node.name,
                target=target,
                args=self.convert(tuple(fx_node.args)),
                kwargs=self.convert(dict(fx_node.kwargs)),
                output=vid,
                stack_trace=fx_node.meta.get("stack_trace"),
            )
        )

    def convert(self, arg: Any) -> Any:
        """Replace fx Nodes in an argument structure with Refs (or inlined attributes)."""
        if isinstance(arg, torch.fx.Node):
            if arg in self.constants:
                return self.constants[arg]
            if arg not in self.ids:
                raise GraphValidationError(
                    f"value %{arg.name} is used before it is defined (dangling value)"
                )
            return Ref(self.ids[arg])
        if isinstance(arg, tuple):
            return tuple(self.convert(a) for a in arg)
        if isinstance(arg, list):
            return [self.convert(a) for a in arg]
        if isinstance(arg, dict):
            return {k: self.convert(v) for k, v in arg.items()}
        return arg


_INPUT_KINDS = {
    TorchInputKind.USER_INPUT: InputKind.USER_INPUT,
    TorchInputKind.PARAMETER: InputKind.PARAMETER,
    TorchInputKind.BUFFER: InputKind.BUFFER,
    TorchInputKind.CONSTANT_TENSOR: InputKind.CONSTANT,
    TorchInputKind.CUSTOM_OBJ: InputKind.CONSTANT,
    TorchInputKind.TOKEN: InputKind.TOKEN,
}

_OUTPUT_KINDS = {
    TorchOutputKind.USER_OUTPUT: OutputKind.USER_OUTPUT,
    TorchOutputKind.BUFFER_MUTATION: OutputKind.BUFFER_MUTATION,
    TorchOutputKind.USER_INPUT_MUTATION: OutputKind.USER_INPUT_MUTATION,
    TorchOutputKind.TOKEN: OutputKind.TOKEN,
}


def _has_mutating_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls an op that mutates its arguments or has registered effects."""
    for node in gm.graph.nodes:
        target = node.target
        if (
            node.op == "call_function"
            and isinstance(target, torch._ops.OpOverload)
            and (target._schema.is_mutable or _has_effects(target))
        ):
            return True
    return False


def _has_effects(op: torch._ops.OpOverload) -> bool:
    """Whether `op` is registered as effectful: functionalization threads effect tokens
    through such ops (with_effects), which is what keeps them in order in a dataflow run."""
    try:
        from torch._higher_order_ops.effects import has_effects
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(has_effects(op))


def _global_state_functions() -> frozenset[Any]:
    found: list[Any] = [torch._C._set_grad_enabled]
    autocast = getattr(torch.amp, "autocast_mode", None)
    for name in ("_enter_autocast", "_exit_autocast"):
        if hasattr(autocast, name):
            found.append(getattr(autocast, name))
    return frozenset(found)


_GLOBAL_STATE_FUNCTIONS = _global_state_functions()


def _has_global_state_calls(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls functions that change thread-local state as separate nodes.

    Pre-dispatch programs (torch.vmap, grad mode, autocast) contain calls such as
    `_vmap_increment_nesting` that have no data dependence on the nodes they affect; a dataflow
    schedule cannot keep them in order or on one thread, so such programs are lowered first.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if getattr(target, "__module__", None) == "torch._functorch.predispatch":
            return True
        if any(target is f for f in _GLOBAL_STATE_FUNCTIONS):
            return True
    return False


def _lookup_weight(ep: ExportedProgram, name: str) -> Any:
    if name in ep.state_dict:
        return ep.state_dict[name]
    if name in ep.constants:
        return ep.constants[name]
    raise ProgramLoadError(
        f"weight {name!r} is named by the signature but missing from the program"
    )


def _mutated_input_path(
    ep: ExportedProgram, inputs: list[InputSpec], builder: _FxImporter, target: str | None
) -> str | None:
    """The user-input path of the placeholder a USER_INPUT_MUTATION output writes back to."""
    for spec in inputs:
        if spec.kind is InputKind.USER_INPUT and builder.values[spec.value].name == target:
            return spec.target
    raise GraphValidationError(f"output mutates user input {target!r}, which is not an input")


def _user_input_paths(
    in_spec: pytree.TreeSpec | None, count: int, arg_names: tuple[str, ...] = ()
) -> list[str]:
    """The flat user inputs' paths in the user's words, computed once at load for every
    message that names an input: `x` (a positional parameter, by `arg_names`), `mask` (a
    keyword), `inputs['a'][0]` (into a structure); `args[0]` / `kwargs['k']` where no name is
    known."""
    fallback = [f"args[{i}]" for i in range(count)]
    if in_spec is None:
        return fallback
    dummy = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    paths = []
    for path, _ in pytree.tree_flatten_with_path(dummy)[0]:
        if len(path) < 2:
            return fallback
        side, first, rest = getattr(path[0], "idx", None), path[1], pytree.keystr(path[2:])
        index, key = getattr(first, "idx", None), getattr(first, "key", None)
        if side == 0 and isinstance(index, int):
            paths.append((arg_names[index] if index < len(arg_names) else f"args[{index}]") + rest)
        elif side == 1 and isinstance(key, str):
            paths.append((key if key.isidentifier() else f"kwargs[{key!r}]") + rest)
        else:
            return fallback
    return paths if len(paths) == count else fallback


def _export_arg_names(ep: ExportedProgram, module: torch.nn.Module) -> list[str]:
    """The forward's argument names as ep.module() takes them (positional, then keywords):
    export keeps them in its module call graph (a loaded .pt2 too)."""
    try:
        names = ep.module_call_graph[0].signature.forward_arg_names  # type: ignore[union-attr]
        if names:
            return [str(n) for n in names]
    except (AttributeError, IndexError):
        pass
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _positional_names(names: list[str], in_spec: pytree.TreeSpec | None) -> tuple[str, ...]:
    """The names of the (args, kwargs) spec's positional arguments: the first of `names`,
    when they fit (as many, distinct identifiers, none a keyword's); () otherwise."""
    if in_spec is None:
        return ()
    args_spec, kwargs_spec = spec_children(in_spec)
    count = args_spec.num_children
    positional = names[:count]
    keywords = set(kwargs_spec.context or ())
    if (len(positional) != count or len(set(positional)) != count or keywords & set(positional)
            or not all(n.isidentifier() for n in positional)):
        return ()
    return tuple(positional)


def _fx_in_spec(gm: torch.fx.GraphModule) -> pytree.TreeSpec | None:
    """The input spec of a pytree-flattening GraphModule, as (args, kwargs): ep.module()'s
    is already; make_fx's holds the positional arguments only (fx's codegen tells the two
    apart by the same test)."""
    info = getattr(getattr(gm.graph, "_codegen", None), "pytree_info", None)
    spec: pytree.TreeSpec | None = getattr(info, "in_spec", None)
    if spec is None:
        return None
    children = spec_children(spec)
    if (spec.type is tuple and len(children) == 2 and children[0].type is tuple
            and children[1].type is dict):
        return spec
    if spec.type is not tuple:
        spec = pytree.TreeSpec(tuple, None, [spec])
    return pytree.TreeSpec(tuple, None, [spec, pytree.tree_structure({})])


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _lower(lower: Any) -> int:
    """A range's lower bound as an int; -int_oo (unbacked and int inputs) becomes -2**63, the
    smallest value a size or a SymInt can hold, since the signature stores lower bounds as ints.
    """
    if lower is -int_oo or lower is -sympy.oo:
        return -(2**63)
    try:
        return int(lower)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return -(2**63)


def _upper(upper: Any) -> float:
    """A range's upper bound as an int, or inf for sympy.oo and torch's int_oo.

    int_oo claims to be finite and int() of it raises AttributeError, hence the explicit test.
    """
    if upper is int_oo or upper is sympy.oo:
        return float("inf")
    try:
        return int(upper)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return float("inf")


def _meta_spec(fx_node: torch.fx.Node) -> ValueSpec | None:
    val = fx_node.meta.get("val", fx_node.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        return _spec_of(val)
    if isinstance(val, torch.SymInt):
        return ScalarSpec(int, None, fixed=False, expr=val.node.expr)
    if isinstance(val, torch.SymFloat):
        return ScalarSpec(float, None, fixed=False)
    if isinstance(val, torch.SymBool):
        return ScalarSpec(bool, None, fixed=False)
    if (
        fx_node.op == "placeholder"
        and (val is None or isinstance(val, (int, float, bool, str)))
        and "val" in fx_node.meta
    ):
        return ScalarSpec(type(val), val)
    return None


def _spec_of(t: torch.Tensor) -> TensorSpec:
    shape: list[Any] = []
    hint: list[int] = []
    for d in t.shape:
        if isinstance(d, torch.SymInt):
            shape.append(d.node.expr)
            hint.append(_hint(d))
        else:
            shape.append(int(d))
            hint.append(int(d))
    return TensorSpec(t.dtype, t.device, tuple(shape), tuple(hint))


def _hint(d: torch.SymInt) -> int:
    try:
        h = d.node.hint
        return int(h) if h is not None else 1
    except Exception:
        return 1
