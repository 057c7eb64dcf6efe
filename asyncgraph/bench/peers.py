"""The peers asyncgraph is measured against, built from the same fx graph it runs.

Graph-level peers (a plain Python loop, torch.fx.Interpreter, dask) all start from an
`FxProgram`: a flat fx graph whose placeholders are either user inputs or constants (weights,
detached so that no peer pays for autograd). For an ExportedProgram that is the lifted
`ep.graph_module`, the very graph asyncgraph imports, so every peer calls the same aten ops in
the same order. Module-level peers (eager `model(x)`, `ep.module()`) run the user's callables.

Every sync peer runs under `torch.inference_mode()`, as asyncgraph's kernels do by default, so
nobody records autograd and eager modules may take their inference fast paths.

dask is a peer, not a dependency of asyncgraph (its dev extra installs it): where it does not
import, the dask peers are left out and each case that would have had them says so in one line
(`left_out`, the case's notes), so an installed `asyncgraph bench` runs without it.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from asyncgraph.bench.harness import Peer, sync_peer


@dataclass
class FxProgram:
    """A flat fx graph with its non-input placeholders bound to constants."""

    gm: torch.fx.GraphModule
    placeholders: list[str]  # every placeholder, in graph order
    inputs: list[str]  # the user-input placeholders, in call order
    constants: dict[str, Any]  # placeholder or get_attr name -> value
    outputs: Any  # the output structure, fx Nodes as leaves

    def call_args(self, inputs: Sequence[Any]) -> list[Any]:
        """The placeholders' values for one call, in graph order."""
        given = dict(zip(self.inputs, inputs, strict=True))
        return [given[n] if n in given else self.constants[n] for n in self.placeholders]


def from_exported(ep: ExportedProgram) -> FxProgram:
    """The lifted graph of `ep`: weights become constants, user inputs stay inputs."""
    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: list[str] = []
    constants: dict[str, Any] = {}
    for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True):
        if spec.kind is InputKind.USER_INPUT:
            inputs.append(node.name)
        else:
            assert spec.target is not None
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            constants[node.name] = _detach(value)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    user = [
        arg for arg, spec in zip(out.args[0], ep.graph_signature.output_specs, strict=True)
        if spec.kind.name == "USER_OUTPUT"
    ]
    return FxProgram(gm, [n.name for n in placeholders], inputs, constants, user)


def from_graph_module(gm: torch.fx.GraphModule) -> FxProgram:
    """A GraphModule's graph: placeholders are inputs, get_attr tensors are constants."""
    constants: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            constants[node.name] = _detach(obj)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return FxProgram(gm, names, list(names), constants, out.args[0])


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


# -- a plain Python loop ----------------------------------------------------------------------


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def python_loop(prog: FxProgram) -> Callable[[Sequence[Any]], list[Any]]:
    """The 20 lines anyone would write: walk the nodes in order, call each op, keep results.

    Arguments are resolved from a list of slots; no value is ever freed early and nothing is
    checked, so this is the floor for interpreting a graph from Python.
    """
    slots: dict[str, int] = {}
    template: list[Any] = []
    input_slots: list[int] = []
    steps: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], int, bool]] = []

    def slot(name: str, value: Any = None) -> int:
        slots[name] = len(template)
        template.append(value)
        return slots[name]

    def convert(arg: Any) -> tuple[Any, bool]:
        if isinstance(arg, torch.fx.Node):
            return _Slot(slots[arg.name]), False
        if isinstance(arg, (list, tuple)):
            items = [convert(a) for a in arg]
            nested = any(isinstance(a, _Slot) or n for a, n in items)
            return type(arg)(a for a, _ in items), nested
        return arg, False

    for node in prog.gm.graph.nodes:
        if node.op == "placeholder":
            i = slot(node.name, prog.constants.get(node.name))
            if node.name in prog.inputs:
                input_slots.append(i)
        elif node.op == "get_attr":
            slot(node.name, prog.constants[node.name])
        elif node.op == "call_function":
            converted = [convert(a) for a in node.args]
            kwargs = {k: convert(v) for k, v in node.kwargs.items()}
            nested = any(n for _, n in converted) or any(n for _, n in kwargs.values())
            nested = nested or any(isinstance(v, _Slot) for v, _ in kwargs.values())
            fn = getattr(node.target, "_op", node.target)
            steps.append((
                fn, tuple(a for a, _ in converted), {k: v for k, (v, _) in kwargs.items()},
                slot(node.name), nested,
            ))
    out_slots = [slots[n.name] for n in pytree.tree_leaves(prog.outputs)]
    order = [input_slots[prog.inputs.index(n)] for n in prog.inputs]

    def resolve(v: list[Any], a: Any) -> Any:
        if type(a) is _Slot:
            return v[a.i]
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(v, x) for x in a)
        return a

    def run(inputs: Sequence[Any]) -> list[Any]:
        v = list(template)
        for i, x in zip(order, inputs, strict=True):
            v[i] = x
        with torch.inference_mode():
            for fn, args, kwargs, out, nested in steps:
                if nested:
                    v[out] = fn(*[resolve(v, a) for a in args],
                                **{k: resolve(v, a) for k, a in kwargs.items()})
                else:
                    v[out] = fn(*[v[a.i] if type(a) is _Slot else a for a in args], **kwargs)
        return [v[i] for i in out_slots]

    return run


# -- torch.fx.Interpreter ---------------------------------------------------------------------


def fx_interpreter(prog: FxProgram) -> Callable[[Sequence[Any]], Any]:
    """torch.fx.Interpreter over the same graph (it frees values after their last use)."""
    interp = torch.fx.Interpreter(prog.gm)

    def run(inputs: Sequence[Any]) -> Any:
        with torch.inference_mode():
            out = interp.run(*prog.call_args(inputs))
        return _user_outputs(prog, out)

    return run


def _user_outputs(prog: FxProgram, out: Any) -> list[Any]:
    leaves = pytree.tree_leaves(out)
    return leaves[: len(pytree.tree_leaves(prog.outputs))]


# -- dask ---------------------------------------------------------------------------------------


def dask_graph(prog: FxProgram) -> tuple[dict[str, Any], list[str]]:
    """The graph as a dask task graph: one Task per node, TaskRefs for its inputs.

    Input placeholders are left out; `dask_runner` adds them as DataNodes for each call.
    """
    from dask._task_spec import DataNode, List, Task, TaskRef, Tuple

    dsk: dict[str, Any] = {}

    def convert(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return TaskRef(arg.name)
        if isinstance(arg, (list, tuple)):
            items = [convert(a) for a in arg]
            if any(isinstance(a, (TaskRef, List, Tuple)) for a in items):
                return List(*items) if isinstance(arg, list) else Tuple(*items)
            return type(arg)(items)
        return arg

    for node in prog.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") and node.name in prog.constants:
            dsk[node.name] = DataNode(node.name, prog.constants[node.name])
        elif node.op == "call_function":
            fn = _no_grad(node.target)
            args = [convert(a) for a in node.args]
            kwargs = {k: convert(v) for k, v in node.kwargs.items()}
            dsk[node.name] = Task(node.name, fn, *args, **kwargs)
    outputs = [n.name for n in pytree.tree_leaves(prog.outputs)]
    return dsk, outputs


def _no_grad(target: Any) -> Callable[..., Any]:
    """dask runs tasks on its own threads, where inference_mode is off (it is thread-local)."""
    fn = getattr(target, "_op", target)
    if target is operator.getitem:
        return fn  # type: ignore[no-any-return]

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return call


def dask_runner(
    prog: FxProgram, threaded: bool, workers: int = 2
) -> Callable[[Sequence[Any]], Any]:
    import dask.local
    import dask.threaded
    from dask._task_spec import DataNode

    static, outputs = dask_graph(prog)

    def run(inputs: Sequence[Any]) -> Any:
        dsk = dict(static)
        for name, x in zip(prog.inputs, inputs, strict=True):
            dsk[name] = DataNode(name, x)
        if threaded:
            return list(dask.threaded.get(dsk, outputs, num_workers=workers))
        return list(dask.local.get_sync(dsk, outputs))

    return run


DASK_MODULES = ("dask._task_spec", "dask.local", "dask.threaded")  # what the dask peers import


def dask_missing() -> str | None:
    """Why the dask peers cannot run here, in one line naming where dask comes from; None
    when they can."""
    try:
        for module in DASK_MODULES:
            importlib.import_module(module)
    except ImportError as exc:
        return (f"dask peers left out: dask is not importable ({exc}); install it with "
                "pip install dask (asyncgraph's dev extra has it)")
    return None


def dask_peers(prog: FxProgram, inputs: Sequence[Any], workers: int = 2) -> list[Peer]:
    """dask.local.get_sync and dask.threaded.get over `prog`; none where dask is missing."""
    if dask_missing() is not None:
        return []
    sync = dask_runner(prog, threaded=False)
    threaded = dask_runner(prog, threaded=True, workers=workers)
    return [
        sync_peer("dask get_sync", lambda: sync(inputs), "dask.local.get_sync"),
        sync_peer("dask threaded", lambda: threaded(inputs),
                  f"dask.threaded.get, {workers} workers"),
    ]


def left_out() -> list[str]:
    """The notes of a case whose peers include dask's (CaseResult.notes): why they are left
    out, one line, or nothing when they ran."""
    why = dask_missing()
    return [] if why is None else [why]


# -- peers --------------------------------------------------------------------------------------


def in_inference(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with torch.inference_mode():
            return fn(*args)

    return call


def asyncgraph_peer(
    name: str, ex: Any, inputs: Sequence[Any], note: str = "", settle_s: float = 0.0
) -> Peer:
    """`await ex.execute(*inputs)` as a peer."""
    execute = ex.execute

    async def call() -> Any:
        return await execute(*inputs)

    return Peer(name, call, note, settle_s)


def graph_peers(
    prog: FxProgram, inputs: Sequence[Any], *, dask_workers: int = 2, loop: bool = True
) -> list[Peer]:
    """python loop, torch.fx.Interpreter, dask get_sync and dask threaded over `prog` (the
    dask ones where dask imports: `left_out`)."""
    peers: list[Peer] = []
    if loop:
        run_loop = python_loop(prog)
        peers.append(sync_peer("python loop", lambda: run_loop(inputs),
                               "a list of slots and a for loop over the nodes"))
    interp = fx_interpreter(prog)
    peers.append(sync_peer("fx.Interpreter", lambda: interp(inputs), "torch.fx.Interpreter"))
    return peers + dask_peers(prog, inputs, dask_workers)


def module_peers(
    model: Callable[..., Any], ep: ExportedProgram | None, inputs: Sequence[Any]
) -> list[Peer]:
    """Eager `model(x)` and `ep.module()(x)`, both under inference_mode."""
    eager = in_inference(model)
    peers = [sync_peer("eager model(x)", lambda: eager(*inputs), "the nn.Module itself")]
    if ep is not None:
        module = in_inference(ep.module())
        peers.append(sync_peer("ep.module()", lambda: module(*inputs),
                               "the unlifted GraphModule torch.export gives back"))
    return peers
