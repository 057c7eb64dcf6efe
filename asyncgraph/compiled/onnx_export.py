"""A run of aten nodes as an ONNX model: the export half of ONNX segments (onnx_segments.py).

`export_segment` turns a segment's fx module (compiled/build.py's `segment_module`) into the
bytes of an ONNX model that ONNX Runtime loads:

1. asyncgraph's own fused node, `_addmm_activation` (passes/epilogue.py), which torch's ONNX
   exporter has no translation for, is put back as `addmm` and `relu` / exact `gelu`, and
   self-attention blocks become one call that translates to ONNX Runtime's `Attention` node
   (onnx_attention.py; the segment is exported without it when that translation fails);
2. the module is exported with torch.export (dims that are symbolic in the program stay
   dynamic: Dim.AUTO) and translated by torch.onnx's exporter with onnxscript's torchlib. The
   translation is tried first without decompositions (0.1 s for tiny BERT's 40-node segment
   against 0.8 s more for `run_decompositions`), and decomposed only when an op has no ONNX
   function. The registry of ONNX functions is built once per process (~2 s), not per export
   as `torch.onnx.export(dynamo=True)` does;
3. each weight input becomes an initializer without data ("external" data that the session
   receives from the weight tensors' memory through `add_external_initializers`), so that
   ONNX Runtime folds and pre-packs the weights as constants, and one exported model serves
   every weights version: a swap makes a new session, never a new export. A weight input that
   no node reads any more (the exporter dropped its readers, or the optimizer folded them)
   gets no initializer, and sessions are not given it (`OnnxModel.unread`): ONNX Runtime
   refuses an external initializer its model lacks.

Before the weights are baked, onnxscript's optimizer folds what the exporter left to compute
per call (the attention scale from the input's shape) and rewrites patterns ONNX Runtime then
fuses: tiny BERT's session runs 9% faster, as fast as a whole-model `torch.onnx.export`'s.
Exact GELU then becomes ONNX Runtime's `Gelu` contrib op (`_gelu_fused`), which its own
optimizer misses in the order torchlib writes it: 5-6% faster again on tiny BERT. Last,
layout moves of size-1 dimensions in a static segment become Reshapes (onnx_shapes.py).

Exports are cached per process by the module's code and its inputs' specs: the same graph
built twice (two Executors of one program) exports once; and on disk (export_cache.py), so a
restart or another process on the machine does not export again.

The exporter's internals (`torch.onnx._internal.exporter`) are used when present; without them
the public `torch.onnx.export(..., dynamo=True)` does the same, slower.
"""

from __future__ import annotations

import logging
import pickle
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from asyncgraph.compiled import export_cache
from asyncgraph.compiled.child_process import last_line, run_child
from asyncgraph.compiled.onnx_attention import TARGET as ATTENTION
from asyncgraph.compiled.onnx_attention import attention_fused, attention_onnx
from asyncgraph.runtime.forms import building_off_loop

ONNX_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool,
})  # what crosses a segment's boundary: numpy and ONNX Runtime both hold these
EXTERNAL = "asyncgraph-weights"  # the external data "file" of baked weights (never read)
CACHE_SIZE = 64
# what this module makes of a segment, in the disk cache's key: raised when the same segment
# exports to another model (3: attention blocks as one node, onnx_attention.py)
REVISION = 3
# ONNX Runtime 1.32's constant folding inlines If branches and crashes the process on some
# (torchlib's embedding_bag: a Loop and nested Ifs, SIGSEGV at every optimisation level): a
# model with these nodes gets its session without the ConstantFolding transformer.
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
_TARGETS = re.compile(r"op='([\w.]+)', overload='(\w+)'")  # in "No ONNX function found for"

aten = torch.ops.aten
LOG = logging.getLogger("asyncgraph.onnx")


class ExportFailed(Exception):
    """The segment has no ONNX model; `op` is the aten op the exporter had no translation
    for, when it named one."""

    def __init__(self, reason: str, op: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.op = op


@dataclass(frozen=True)
class InputSpec:
    """What export_segment needs of one segment input."""

    dtype: torch.dtype
    shape: tuple[Any, ...]  # ints, or sympy expressions for dims symbolic in the program
    hint: tuple[int, ...]
    baked: bool  # a weight: an initializer of the model


@dataclass(frozen=True)
class OnnxModel:
    """The ONNX model of a segment: `inputs[i]` is the ONNX input (or initializer, when the
    segment's input i is baked) that takes the segment's input i; `outputs` in order."""

    model: bytes
    inputs: tuple[str, ...]
    baked: tuple[bool, ...]
    outputs: tuple[str, ...]
    decomposed: bool  # whether the exporter's decompositions had to run
    control_flow: bool = False  # If, Loop or Scan nodes: ONNX Runtime must not fold constants
    # baked inputs no node of the model reads (the exporter or its optimizer dropped their
    # readers): no initializer, and a session is not given them (ONNX Runtime refuses an
    # external initializer the model lacks)
    unread: tuple[str, ...] = ()


def export_segment(module: torch.fx.GraphModule, specs: Sequence[InputSpec]) -> OnnxModel:
    """The ONNX model of `module` (one placeholder per entry of `specs`, a tuple out), or
    ExportFailed with why."""
    key = (module.code, tuple(specs))
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            _CACHE.move_to_end(key)
            return cached
    disk_key = export_cache.key_of("onnx", REVISION, module.code, tuple(specs))
    exported = export_cache.load("onnx", disk_key, OnnxModel)
    if exported is None:
        if building_off_loop():  # a fast form: in a child, sharing no GIL with the loop
            exported = export_elsewhere(module, list(specs))
        else:
            exported = _export(module, specs)
        export_cache.store("onnx", disk_key, exported)
    with _LOCK:
        _CACHE[key] = exported
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return exported


EXPORT_TIMEOUT_S = 600.0  # a child's export that takes longer is given up on (stays plain)


def export_elsewhere(module: torch.fx.GraphModule, specs: list[InputSpec]) -> OnnxModel:
    """`_export(module, specs)` run in a child process (export_worker.py says why); the
    same OnnxModel, or ExportFailed with the child's reason and op."""
    try:
        job: bytes | None = pickle.dumps((module, specs))
    except Exception as exc:  # a module that does not pickle: exported here instead
        LOG.debug("exporting in process: the segment does not pickle (%s)", exc)
        return _export(module, specs)
    done = run_child("asyncgraph.compiled.export_worker", job, EXPORT_TIMEOUT_S, "export",
                     ExportFailed)
    try:
        answer = pickle.loads(done.stdout)
    except Exception:  # a crash: no answer, the reason is on stderr
        raise ExportFailed(
            f"the export process exited {done.returncode}: {last_line(done)}") from None
    if answer[0] == "ok":
        model: OnnxModel = answer[1]
        return model
    raise ExportFailed(answer[1], _op_named(answer[2]))


def _op_named(name: str | None) -> Any:
    """The aten op named `name` ("aten.embedding_bag.padding_idx"), or None."""
    if name is None:
        return None
    namespace, packet, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except AttributeError:
        return None


_LOCK = threading.Lock()
_CACHE: OrderedDict[Any, OnnxModel] = OrderedDict()
_REGISTRY: list[Any] = []  # the torchlib registry, built on first use


def _export(module: torch.fx.GraphModule, specs: Sequence[InputSpec]) -> OnnxModel:
    """The translation itself. onnx and onnxscript are imported here, not with the module:
    their extensions take 0.1-0.5 s to load, holding the GIL for up to 75 ms at a time, and a
    segment found in the disk cache (export_cache.py) never needs them."""
    import onnxscript  # noqa: F401 - torch.onnx's translations

    for spec in specs:
        if spec.dtype not in ONNX_DTYPES:
            raise ExportFailed(f"an input of dtype {spec.dtype} (not one ONNX Runtime takes)")
    module = _unfused(module)
    names = [n.name for n in module.graph.find_nodes(op="placeholder")]
    args = tuple(torch.zeros(s.hint, dtype=s.dtype) for s in specs)
    dynamic = tuple(
        {d: torch.export.Dim.AUTO for d, size in enumerate(s.shape) if not isinstance(size, int)}
        or None for s in specs)
    fused = attention_fused(module, args)
    try:
        proto, decomposed = _translated(fused, names, args, dynamic)
    except ExportFailed as exc:
        if fused is module:
            raise
        LOG.debug("exporting without the attention fusion: %s", exc.reason)
        proto, decomposed = _translated(module, names, args, dynamic)
    by_name = {i.name: i for i in proto.graph.input}
    if set(by_name) != set(names):
        raise ExportFailed(f"the ONNX model's inputs {sorted(by_name)} are not the segment's "
                           f"{names}")
    outputs = tuple(o.name for o in proto.graph.output)
    if len(outputs) != len(_outputs(module)):
        raise ExportFailed(f"the ONNX model has {len(outputs)} outputs, the segment "
                           f"{len(_outputs(module))}")
    kept = [i for i in proto.graph.input if i.name not in
            {n for n, s in zip(names, specs, strict=True) if s.baked}]
    read = _read_names(proto)
    unread = tuple(n for n, s in zip(names, specs, strict=True) if s.baked and n not in read)
    for name, spec in zip(names, specs, strict=True):
        if spec.baked and name in read:
            proto.graph.initializer.append(_external(name, spec))
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    control_flow = any(n.op_type in CONTROL_FLOW for graph in [proto.graph, *proto.functions]
                       for n in graph.node)
    return OnnxModel(proto.SerializeToString(), tuple(names), tuple(s.baked for s in specs),
                     outputs, decomposed, control_flow, unread)


def _translated(module: torch.fx.GraphModule, names: Sequence[str], args: tuple[Any, ...],
                dynamic: tuple[Any, ...]) -> tuple[Any, bool]:
    """The optimised ModelProto of `module`, and whether it had to be decomposed first."""
    from asyncgraph.compiled.onnx_shapes import reshapes_simplified

    with quiet_exporter():
        try:
            program = _torch_export(module, args, dynamic)
        except Exception as exc:
            raise ExportFailed(f"torch.export: {_first_line(exc)}") from exc
        proto, decomposed = _to_onnx(program, module, args, dynamic)
        return reshapes_simplified(_optimized(proto, names)), decomposed


def _read_names(proto: Any) -> set[str]:
    """The names the model's nodes read: of its graph, its functions and the graphs in their
    attributes (If and Loop bodies)."""
    read: set[str] = set()
    pending = [*proto.graph.node, *(n for function in proto.functions for n in function.node)]
    while pending:
        node = pending.pop()
        read.update(node.input)
        for attribute in node.attribute:
            if attribute.HasField("g"):
                pending.extend(attribute.g.node)
            for graph in attribute.graphs:
                pending.extend(graph.node)
    return read


def _to_onnx(program: Any, module: torch.fx.GraphModule, args: tuple[Any, ...],
             dynamic: tuple[Any, ...]) -> tuple[Any, bool]:
    """The ModelProto of `program`, and whether it had to be decomposed first."""
    try:
        from torch.onnx._internal.exporter import _core, _fx_passes
    except ImportError:  # the public exporter: decomposes and builds its registry every time
        try:
            onnx_program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic, optimize=False,
                verbose=False, custom_translation_table={ATTENTION: attention_onnx})
        except Exception as exc:
            op = _op(exc)
            reason = f"no ONNX function for {op}" if op is not None else _first_line(exc)
            raise ExportFailed(f"torch.onnx.export: {reason}", op) from exc
        assert onnx_program is not None
        return onnx_program.model_proto, True
    registry = _registry()
    try:
        plain = _prepared(program, _fx_passes)
        return _core._exported_program_to_onnx_program(plain, registry=registry).model_proto, False
    except Exception:  # an op without an ONNX function: decompose, as torch.onnx.export does
        pass
    try:
        decomposed = _core._prepare_exported_program_for_export(
            _torch_export(module, args, dynamic), registry=registry)
        return (_core._exported_program_to_onnx_program(decomposed, registry=registry)
                .model_proto, True)
    except Exception as exc:
        op = _op(exc)
        reason = f"no ONNX function for {op}" if op is not None else _first_line(exc)
        raise ExportFailed(f"torch.onnx: {reason}", op) from exc


def _optimized(proto: Any, names: Sequence[str]) -> Any:
    """`proto` after onnxscript's optimizer (constant folding of shape arithmetic, pattern
    rewrites: ~0.2 s for tiny BERT), run while the weights are still inputs; unchanged when the
    optimizer fails or drops an input."""
    try:
        import onnxscript.optimizer

        optimized = onnxscript.optimizer.optimize(type(proto).FromString(proto.SerializeToString()))
    except Exception:
        return proto
    if {i.name for i in optimized.graph.input} != set(names):
        return proto
    return _gelu_fused(optimized, names)


def _gelu_fused(proto: Any, names: Sequence[str]) -> Any:
    """`proto` with exact GELU as ONNX Runtime's `Gelu` contrib op, and a bias added before it
    as `BiasGelu` (onnxscript's ORT fusions). torchlib writes exact GELU as
    `x * (0.5 * (erf(x / sqrt(2)) + 1))`, an order ONNX Runtime's own GeluFusion misses, so
    the five nodes ran one by one; fused, tiny BERT's segment ran faster at batch 1
    (benchmarks/results/cpu/design_measurements.md#gelu-fusion). Unchanged when there is no
    such GELU, or the fusions are missing or fail."""
    try:
        from onnxscript import ir
        from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
        from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu

        model = ir.serde.deserialize_model(proto)
        if not fuse_erfgelu(model):
            return proto
        fuse_bias_gelu(model)
        fused = ir.serde.serialize_model(model)
    except Exception:
        return proto
    if {i.name for i in fused.graph.input} != set(names):
        return proto
    return fused


def _torch_export(module: torch.fx.GraphModule, args: tuple[Any, ...],
                  dynamic: tuple[Any, ...]) -> Any:
    """torch.export of the segment, its dynamic dims kept dynamic when the example size is 0
    or 1 (size-oblivious: an unbacked size from `.item()` often is)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)


def _prepared(program: Any, fx_passes: Any) -> Any:
    """`program` with explicit type promotions and without assertion nodes (what the exporter
    does after decomposing)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        fx_passes.insert_type_promotion_nodes(program.graph_module)
        program._graph_module = fx_passes.remove_assertion_nodes(program.graph_module)
    return program


def _registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    with _LOCK:
        if not _REGISTRY:
            registry = _registration.ONNXRegistry.from_torchlib()
            registry.register_op(ATTENTION, attention_onnx)
            _REGISTRY.append(registry)
        return _REGISTRY[0]


def _unfused(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `module` whose `_addmm_activation` nodes are `addmm` and the activation
    again (bitwise the same on the CPU: passes/epilogue.py)."""
    fused = list(module.graph.find_nodes(op="call_function", target=aten._addmm_activation.default))
    if not fused:
        return module
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is aten._addmm_activation.default:
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = dict(node.kwargs)
            gelu = kwargs.pop("use_gelu", False)
            product = graph.call_function(aten.addmm.default, args, kwargs)
            env[node] = graph.call_function(
                aten.gelu.default if gelu else aten.relu.default, (product,))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(module, graph)


def _external(name: str, spec: InputSpec) -> Any:
    """An initializer `name` of the spec's dtype and shape whose data the session is given."""
    import onnx

    tensor = onnx.TensorProto()
    tensor.name = name
    sample = torch.empty(0, dtype=spec.dtype)
    tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(sample.numpy().dtype)
    tensor.dims.extend(spec.hint)
    nbytes = sample.element_size()
    for size in spec.hint:
        nbytes *= size
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", EXTERNAL), ("offset", "0"), ("length", str(nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _outputs(module: torch.fx.GraphModule) -> tuple[Any, ...]:
    (output,) = module.graph.find_nodes(op="output")
    value = output.args[0]
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _op(exc: BaseException) -> Any:
    """The aten op a translation error names ("No ONNX function found for <OpOverload...>")."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if "No ONNX function found for" in text:
            for qualified, overload in _TARGETS.findall(text):
                namespace, _, name = qualified.partition(".")
                try:
                    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
                except AttributeError:
                    return None
        seen = seen.__cause__ or seen.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """No warnings and no torch.onnx log lines (the exporter logs each torchvision op it
    skips) while exporting."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)

