"""compile_program: an exported program, its hot runs of nodes compiled by AOTInductor.

1. Import the program and run it once, node by node, on its example inputs (the ones saved
   with it, or random ones of the exported shapes), keeping every intermediate value: these
   are the example inputs of the segments.
2. Find the segments (asyncgraph/compiled/segments.py). A segment whose boundary carries a
   non-tensor (a SymInt, a list) is narrowed until none does: the compiled model takes and
   returns tensors only.
3. Each segment becomes an fx GraphModule of its nodes: a buffer per weight it reads (a
   parameter, buffer or constant the program does not mutate: AOTInductor bakes it in as a
   constant it can fold), a placeholder per other value it reads from outside, its outputs as
   a tuple. It is exported with Dim.AUTO on every dimension that is symbolic in the program,
   and compiled with torch._inductor.aoti_compile_and_package under SWAPPABLE_CONSTANTS (every
   weight stays a constant that the constant-buffer update reaches). A segment that fails to
   export or compile, or whose dynamic dimension the export specialised, stays interpreted,
   and the report says why.
4. The package (asyncgraph/compiled/package.py) holds the original program, one AOTI model per
   segment and the manifest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import io
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from asyncgraph.compiled.choice import choose_kernels
from asyncgraph.compiled.package import SegmentRecord, load_compiled, write_package
from asyncgraph.compiled.packing import PackedConstant, PackingError, find_packed, verify_packed
from asyncgraph.compiled.segments import Segment, tensor_bounded_segments
from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph.importers import Program, from_exported_program, load_pt2
from asyncgraph.graph.initial import initial_values
from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, OutputKind, TensorSpec
from asyncgraph.kernels import KernelFactory
from asyncgraph.kernels.cost import estimate_cost
from asyncgraph.passes.rewrite import read_only_as, substitute
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.tools.compare import random_flat_inputs

Progress = Callable[[str], None]

# Inductor settings that keep every weight a constant the buffer update reaches: small
# tensors are not inlined into the kernels as literals, and whatever inductor folds from the
# weights (transposes, pre-packed matrices) is folded at run time, from the constants, again
# after each update, rather than once at compile time.
SWAPPABLE_CONSTANTS: dict[str, Any] = {
    "always_keep_tensor_constants": True,
    "aot_inductor.use_runtime_constant_folding": True,
}
# compile_program(autotune=True): max-autotune may pick inductor's C++ micro-GEMM, which packs
# its weight into a blocked constant at compile time (MLP of benchmarks/nativert_compare.py:
# half the time of the default kernels); packing.py makes those constants swappable. Runtime
# constant folding does not compile with that GEMM, so it is left out.
AUTOTUNE: dict[str, Any] = {
    "always_keep_tensor_constants": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


@dataclass(frozen=True)
class FailedSegment:
    """A segment left interpreted: its nodes and why."""

    nodes: tuple[str, ...]
    reason: str


@dataclass
class CompileReport:
    """What `compile_program` did: segments compiled, nodes compiled of all, time and size."""

    path: Path
    mode: str
    segments: list[SegmentRecord] = field(default_factory=list)
    failed: list[FailedSegment] = field(default_factory=list)
    nodes_total: int = 0
    compile_s: float = 0.0
    package_bytes: int = 0
    threads: int = 1  # the intra-op thread count the kernels were built for

    @property
    def nodes_compiled(self) -> int:
        return sum(len(s.nodes) for s in self.segments)


def compile_program(
    source: ExportedProgram | str | os.PathLike[str],
    output: str | os.PathLike[str],
    mode: str = "auto",
    *,
    example_inputs: Sequence[Any] | None = None,
    progress: Progress | None = None,
    inductor_configs: dict[str, Any] | None = None,
    autotune: bool = False,
    keep_faster: bool = True,
    threads: int | None = None,
) -> CompileReport:
    """Compile `source` (an ExportedProgram or a .pt2 path) into the package `output`.

    `example_inputs` are flat user inputs to trace the segments with; by default the inputs
    saved with the program, else random ones of its exported shapes. `autotune` compiles
    with AUTOTUNE (max-autotune: faster matmuls, minutes more of compile); the weights it packs
    into the C++ GEMM's layout are traced to their sources (packing.py) so that swaps repack
    them, and a segment where that fails is marked frozen: it refuses `swap_weights` of its
    weights, saying why. With `keep_faster` (the default) each segment is compiled with the
    default kernels too, both are timed here on the example inputs, and the autotuned one is
    kept only where it is faster (choice.py); the manifest says which and by how much.

    `threads` is the intra-op thread count the kernels are built for; None takes the count an
    Executor's workers run with on this machine (`ExecutorConfig.intra_op_threads_or_default`),
    as the kernels are already built for this machine's CPU. At 1, inductor emits no OpenMP
    regions, whose entry costs even with a team of one: compiled tiny BERT and the encoder took
    3-4% less time at batch 1 on the 2-CPU development machine (373 against 388 us, 350
    against 360 us), the same under 64 callers. The manifest records the count; loading the
    package for workers that run more threads logs that its kernels use fewer.
    """
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    ep = _exported(source)
    program = from_exported_program(ep)
    graph = program.graph
    if threads is None:
        threads = ExecutorConfig().intra_op_threads_or_default
    inductor_configs = {"cpp.threads": threads, **(inductor_configs or {})}
    report = CompileReport(Path(output), mode, nodes_total=len(graph.nodes), threads=threads)
    inputs = list(example_inputs) if example_inputs is not None else default_inputs(ep, graph)
    say(f"running the program once on its example inputs ({len(graph.nodes)} nodes)")
    values = example_values(program, inputs)
    larger = _larger_values(program, inputs) if autotune and keep_faster else None
    segments = tensor_bounded_segments(
        graph, mode, lambda vid: isinstance(values[vid], torch.Tensor))
    baked = swappable_weights(graph)
    say(f"{len(segments)} segment(s) to compile ({mode})")
    with tempfile.TemporaryDirectory(prefix="asyncgraph-aoti-") as tmp:
        compiled: list[tuple[SegmentRecord, Path]] = []
        for segment in segments:
            names = tuple(n.name for n in segment.nodes(graph))
            say(f"compiling segment of {len(names)} nodes ({names[0]} .. {names[-1]})")
            name = f"aoti_segment_{len(compiled)}"
            t0 = time.perf_counter()
            try:
                aoti, autotuned, kernels = _compile_kernels(
                    graph, segment, values, baked, Path(tmp) / name, inductor_configs,
                    autotune=autotune, keep_faster=keep_faster, larger=larger)
            except Exception as exc:  # export or inductor refused it: keep it interpreted
                reason = _reason(exc)
                report.failed.append(FailedSegment(names, reason))
                say(f"  left interpreted: {reason}")
                continue
            if kernels:
                say(f"  {kernels}")
            record = SegmentRecord(
                name=name,
                nodes=names,
                inputs=tuple(graph.values[v].name for v in segment.inputs),
                outputs=tuple(graph.values[v].name for v in segment.outputs),
                contiguous=tuple(
                    not isinstance(values[v], torch.Tensor) or values[v].is_contiguous()
                    for v in segment.inputs
                ),
                cost=sum(estimate_cost(n, graph) for n in segment.nodes(graph)),
                constants=tuple(
                    _constant_name(i) if _bakes(v, values, baked) else ""
                    for i, v in enumerate(segment.inputs)),
                compile_s=round(time.perf_counter() - t0, 3),
                autotuned=autotuned,
                kernels=kernels,
                packed=aoti.packed,
                frozen=aoti.frozen,
                transposed=aoti.transposed,
            )
            if aoti.frozen:
                say(f"  weights frozen: {aoti.frozen}")
            compiled.append((record, aoti.path))
        say(f"writing {output}")
        write_package(output, ep, compiled, mode=mode, nodes_total=len(graph.nodes),
                      threads=threads, failed=[{"nodes": list(f.nodes), "reason": f.reason}
                              for f in report.failed])
    say("loading the package back")
    _check_loads(Path(output))
    report.segments = [record for record, _ in compiled]
    report.compile_s = time.perf_counter() - started
    report.package_bytes = Path(output).stat().st_size
    return report


def _exported(source: ExportedProgram | str | os.PathLike[str]) -> ExportedProgram:
    """The program as the package will hold it. An in-memory program goes through
    torch.export's save and load first: loading can change the graph (it adds getitems for
    unused outputs of multi-output ops such as native_layer_norm), and the segments must
    name the nodes of the program that `load` will see."""
    if isinstance(source, ExportedProgram):
        loaded = _round_trip(source)
    else:
        program = load_pt2(source)  # checked by graph/archive/ before torch reads it
        assert program.exported is not None
        loaded = program.exported
    return _without_dead_code(loaded)


def _round_trip(ep: ExportedProgram) -> ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _without_dead_code(ep: ExportedProgram) -> ExportedProgram:
    """`ep` without nodes whose values nothing reads (fx's dead-code elimination keeps every
    node with a side effect). AOTInductor drops such nodes with the constants only they read,
    and a segment's manifest would still list those constants: the package then failed to
    load (a Hugging Face BERT's unused pooler). Saved and loaded again, so that the segments
    name the nodes of the program the package holds. Only aten ops that write nothing go:
    anything else (a torchbind call, an effectful op) stays, whether or not it is read."""
    graph = ep.graph_module.graph
    if not graph.eliminate_dead_code(is_impure_node=lambda node: not _pure_aten(node)):
        return ep
    ep.graph_module.recompile()
    return _round_trip(ep)


def _pure_aten(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and not target._schema.is_mutable
        and not node.is_impure()
    )


def _check_loads(path: Path) -> None:
    """Load the written package as `asyncgraph.load(..., trust_compiled=True)` would: compile
    never leaves a package its own loader refuses. On failure the package is removed and the
    error says so."""
    try:
        load_compiled(path)
    except Exception as exc:
        path.unlink(missing_ok=True)
        raise ProgramLoadError(
            f"{path}: the compiled package did not load back, so it was removed: {exc}"
        ) from exc


# how many times the example's elements the second size autotuned kernels are timed at may hold
LARGER_AT_MOST = 16


def larger_inputs(graph: Graph, inputs: Sequence[Any]) -> tuple[list[Any], str] | None:
    """`inputs` grown along their dynamic dimensions, each to the largest size the program
    allows, in the order they appear, until they hold LARGER_AT_MOST times the example's
    elements (a batch of 2 up to 32 takes all of it), repeating the example's data so token
    ids stay valid; and a label saying the sizes. None when no dimension can grow, or one is
    an expression of symbols (`2*s0`: it would need solving)."""
    signature = graph.signature
    ranges = signature.range_constraints
    sizes: dict[Any, int] = {}  # each symbol's size in the grown inputs
    examples: dict[Any, int] = {}  # and in the example's
    names: dict[Any, str] = {}  # each symbol's Dim name, or the first input dim it sizes
    room = float(LARGER_AT_MOST)  # the growth factor left to spend
    grown: list[Any] = []
    for index, (spec_in, value) in enumerate(zip(signature.user_inputs, inputs, strict=True)):
        spec = graph.values[spec_in.value].spec
        if not isinstance(spec, TensorSpec) or not isinstance(value, torch.Tensor):
            grown.append(value)
            continue
        for dim, size in enumerate(spec.shape):
            if isinstance(size, int):
                continue
            if not isinstance(size, sympy.Symbol):
                return None
            have = value.shape[dim]
            if size not in sizes:
                names[size] = signature.dim_names.get(
                    (index, dim), f"{graph.values[spec_in.value].name}.shape[{dim}]")
                upper = ranges.get(size, (0, math.inf))[1]
                examples[size] = have
                sizes[size] = max(have, int(min(upper, have * room)))
                room /= sizes[size] / have
            if sizes[size] > have:
                want = sizes[size]
                value = value.repeat_interleave(-(-want // have), dim).narrow(dim, 0, want)
        grown.append(value)
    if not any(a is not b for a, b in zip(grown, inputs, strict=True)):
        return None
    return grown, "at " + ", ".join(
        f"{names[sym]} = {n}" for sym, n in sizes.items() if n > examples[sym])


def _larger_values(program: Program, inputs: Sequence[Any]) -> tuple[list[Any], str] | None:
    """The program's values on `larger_inputs`, and their label; None when there are none,
    or when the program refuses them (a guard the grown sizes break): then autotuned kernels
    are judged at the example's size only."""
    larger = larger_inputs(program.graph, inputs)
    if larger is None:
        return None
    try:
        return example_values(program, larger[0]), larger[1]
    except Exception:
        return None


def default_inputs(ep: ExportedProgram, graph: Graph) -> list[Any]:
    """The flat user inputs saved with the program, or random ones of its exported shapes."""
    saved = getattr(ep, "example_inputs", None)
    if saved is not None:
        flat = pytree.tree_leaves(saved)
        if len(flat) == len(graph.signature.user_inputs):
            return flat
    return random_flat_inputs(graph)


def example_values(program: Program, inputs: Sequence[Any]) -> list[Any]:
    """Every value of the program's graph on `inputs`, computed node by node in graph order
    (under no_grad, not inference_mode: export refuses inference tensors). Higher-order ops
    run their subgraphs on executors of their own, which are async: this runs on an event loop
    of its own, on a thread of its own when the caller's thread has one running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_example_values(program, inputs))
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, _example_values(program, inputs)).result()


async def _example_values(program: Program, inputs: Sequence[Any]) -> list[Any]:
    graph = program.graph
    kernels = KernelFactory().create(graph)
    values = initial_values(graph, program.weights, inputs)
    try:
        for node, kernel in zip(graph.nodes, kernels, strict=True):
            with torch.no_grad():
                result = kernel.fn(*substitute(node.args, _Values(values)),
                                   **substitute(node.kwargs, _Values(values)))
                if inspect.isawaitable(result):
                    result = await result
            values[node.output] = result
    finally:
        for kernel in kernels:  # higher-order kernels own executors
            close = getattr(kernel.fn, "aclose", None)
            if close is not None:
                await close()
    return values


class _Values(Mapping[int, Any]):
    """The mapping substitute() reads: value id -> the value, straight from the list."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def __getitem__(self, key: int) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._values)))

    def __len__(self) -> int:
        return len(self._values)


def swappable_weights(graph: Graph) -> dict[int, str]:
    """Value id -> weight name of the weights a segment bakes in as AOTI constants: every
    parameter, buffer and constant the program does not mutate (a buffer it writes back gets a
    new tensor on every call, so it stays a run-time input)."""
    mutated = {o.target for o in graph.signature.outputs if o.kind is OutputKind.BUFFER_MUTATION}
    return {s.value: s.target or "" for s in graph.signature.inputs
            if s.kind in WEIGHT_KINDS and s.target not in mutated}


def _constant_name(index: int) -> str:
    """The name of a segment's input `index` as an AOTI constant (its FQN in the package)."""
    return f"weight_{index}"


def segment_module(
    graph: Graph, segment: Segment, constants: Mapping[int, torch.Tensor] | None = None,
    *, names: bool = False, transposed: Collection[int] = (),
) -> torch.fx.GraphModule:
    """The segment as an fx GraphModule: its outside values in, its outputs out as a tuple.
    An input in `constants` (value id -> tensor) is a buffer of the module instead of a
    placeholder: AOTInductor bakes it in as a constant it can fold and pre-pack; one in
    `transposed` as well, but stored as its contiguous transpose and read through `t()`
    (linear_weights). With `names` its nodes keep the graph's names (an fx error then names
    the graph's node)."""
    fx = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[int, Any] = {}
    for i, vid in enumerate(segment.inputs):
        if constants is not None and vid in constants:
            stored = constants[vid].t().contiguous() if vid in transposed else constants[vid]
            root.register_buffer(_constant_name(i), stored)
            env[vid] = fx.get_attr(_constant_name(i))
            if vid in transposed:
                env[vid] = fx.call_function(torch.ops.aten.t.default, (env[vid],))
        else:
            env[vid] = fx.placeholder(f"in_{i}_{_ident(graph.values[vid].name)}")
    for node in segment.nodes(graph):
        env[node.output] = fx.create_node(
            "call_function", node.target, substitute(node.args, env),
            substitute(node.kwargs, env), name=_ident(node.name) if names else None,
        )
    fx.output(tuple(env[v] for v in segment.outputs))
    return torch.fx.GraphModule(root, fx)


def linear_weights(graph: Graph, segment: Segment, constants: Collection[int]) -> set[int]:
    """The 2-D constants the segment reads only as a `linear`'s weight: baked as their
    contiguous transpose, the layout BLAS multiplies small batches by fastest. AOTInductor
    keeps a weight's transpose a strided view of it (tiny BERT's GEMMs: 22% less time for
    linears over pre-transposed weights, as the Executor's linear lowering finds)."""
    only = read_only_as(segment.nodes(graph), {torch.ops.aten.linear.default: 1})
    return {v for v in constants if _is_matrix(graph, v) and only.get(v, False)}


def _is_matrix(graph: Graph, vid: int) -> bool:
    spec = graph.values[vid].spec
    return isinstance(spec, TensorSpec) and len(spec.shape) == 2


@dataclass
class _CompiledSegment:
    path: Path
    packed: tuple[PackedConstant, ...] = ()
    frozen: str = ""  # why its weights cannot be swapped, if they cannot
    transposed: tuple[str, ...] = ()  # constants stored as their weight's transpose


def _compile_kernels(
    graph: Graph, segment: Segment, values: list[Any], baked: Mapping[int, str], stem: Path,
    extra: dict[str, Any], *, autotune: bool, keep_faster: bool,
    larger: tuple[list[Any], str] | None = None,
) -> tuple[_CompiledSegment, bool, str]:
    """The segment compiled as compile_program's options ask: the compile kept, whether it
    is the autotuned one, and why that one (when both were compiled). `larger`: the values
    of the program on inputs grown along its dynamic dimensions, and how (_larger_values),
    a second size to time the two compiles at."""
    tuned = {**AUTOTUNE, **extra}
    if autotune and not keep_faster:
        return _compile_segment(graph, segment, values, baked, stem.with_suffix(".pt2"),
                                tuned), True, ""
    default = _compile_segment(graph, segment, values, baked, stem.with_suffix(".pt2"),
                               {**SWAPPABLE_CONSTANTS, **extra})
    if not autotune:
        return default, False, ""
    try:
        autotuned = _compile_segment(graph, segment, values, baked,
                                     stem.with_suffix(".autotuned.pt2"), tuned)
    except Exception as exc:
        return default, False, f"default kernels kept: autotuning failed: {_reason(exc)}"
    runtime = [v for v in segment.inputs if not _bakes(v, values, baked)]
    args = [_plain(values[v]) for v in runtime]
    try:
        choice = (choose_kernels(autotuned.path, default.path, args) if larger is None
                  else choose_kernels(autotuned.path, default.path, args,
                                      [_plain(larger[0][v]) for v in runtime], larger[1]))
    except Exception as exc:  # both compiled, but one would not load or run here
        return default, False, f"default kernels kept: timing failed: {_reason(exc)}"
    if choice.keep_autotuned:
        return autotuned, True, choice.describe()
    return default, False, choice.describe()


def _reason(exc: BaseException) -> str:
    """An exception as one line of a report."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _bakes(value: int, values: list[Any], baked: Mapping[int, str]) -> bool:
    """Whether a segment input is a weight the segment bakes in as a constant."""
    return value in baked and isinstance(values[value], torch.Tensor)


def _compile_segment(
    graph: Graph, segment: Segment, values: list[Any], baked: Mapping[int, str], path: Path,
    inductor_configs: dict[str, Any],
) -> _CompiledSegment:
    constants = {v: _plain(values[v]).detach().contiguous() for v in segment.inputs
                 if _bakes(v, values, baked)}
    autotune = bool(inductor_configs.get("max_autotune"))  # packs its weights its own way
    transposed = set() if autotune else linear_weights(graph, segment, constants)
    gm = segment_module(graph, segment, constants, transposed=transposed)
    runtime = [v for v in segment.inputs if v not in constants]
    args = tuple(_plain(values[v]) for v in runtime)
    dynamic = tuple(_dynamic_dims(graph, v) for v in runtime)
    with warnings.catch_warnings():  # torch's tracing notes, not the caller's business
        warnings.simplefilter("ignore")
        exported = torch.export.export(gm, args, dynamic_shapes=dynamic)
        _check_still_dynamic(exported, dynamic, graph, runtime)
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(path),
            inductor_configs=inductor_configs,
        )
    if not autotune:
        names = sorted(_constant_name(segment.inputs.index(v)) for v in transposed)
        return _CompiledSegment(path, transposed=tuple(names))
    weights = {_constant_name(segment.inputs.index(v)): t for v, t in constants.items()}
    return _trace_packing(path, gm, args, weights)


def _trace_packing(path: Path, gm: torch.fx.GraphModule, args: tuple[Any, ...],
                   weights: dict[str, torch.Tensor]) -> _CompiledSegment:
    """The packed constants of an autotuned segment, traced to their weights and checked by a
    swap (packing.py), or why its weights stay frozen."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def reference(moved: Mapping[str, torch.Tensor]) -> Any:
        with torch.no_grad():
            return torch.func.functional_call(gm, dict(moved), args)

    try:
        packed = find_packed(loader, path, weights, args, reference)
        verify_packed(loader, packed, weights, args, reference)
    except PackingError as exc:
        return _CompiledSegment(path, frozen=f"packed weights not swappable: {exc}")
    return _CompiledSegment(path, tuple(packed))


def _plain(value: Any) -> Any:
    """An inference tensor (made by a subgraph's executor) as a plain one: export traces with
    autograd on and refuses inference tensors."""
    if isinstance(value, torch.Tensor) and value.is_inference():
        with torch.inference_mode(False):
            return value.clone()
    return value


def _dynamic_dims(graph: Graph, vid: int) -> dict[int, Any] | None:
    spec = graph.values[vid].spec
    if not isinstance(spec, TensorSpec):
        return None
    dims = {i: Dim.AUTO for i, d in enumerate(spec.shape) if not isinstance(d, int)}
    return dims or None


def _check_still_dynamic(
    exported: ExportedProgram, dynamic: tuple[dict[int, Any] | None, ...], graph: Graph,
    runtime: Sequence[int],
) -> None:
    """Refuse a segment whose export fixed a dimension the program leaves free: its compiled
    code would only be right for the example's size."""
    user = set(exported.graph_signature.user_inputs)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder" and n.name in user]
    for node, dims, vid in zip(placeholders, dynamic, runtime, strict=True):
        val = node.meta.get("val")
        for dim in dims or {}:
            if isinstance(val, torch.Tensor) and isinstance(val.shape[dim], int):
                raise ValueError(
                    f"export specialised dimension {dim} of {graph.values[vid].name} "
                    f"to {val.shape[dim]}, which the program leaves dynamic"
                )


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)
