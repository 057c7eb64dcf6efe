"""OnnxDelegate: one ONNX segment (onnx_segments.py), called by the scheduler like any kernel.

A call on the weights of the latest session and a checked input signature runs that session:
the runtime inputs as numpy views of the tensors, the outputs as tensors over ONNX Runtime's
arrays (no copy either way), the GIL released inside `run`. Everything else takes the slow
path (`_other`): a call on another weights version runs on that version's session when there
is one; an unchecked signature or weights without a session run the segment's fx module and
queue the work for the builder thread (sessions first, then checks on copies of the first
call's inputs); a refused signature runs the fx module for good.

The runtime inputs come before the weights in the delegate node's arguments (the pass orders
them so), so a call finds its weights by slicing and compares them with the session's by
identity. A segment whose runtime inputs all have static shapes has one signature, and its
calls skip computing it.

The builder thread, the plain nodes' run and the check against them are delegate_support.py's,
shared with the scripted delegate.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort  # type: ignore[import-untyped,import-not-found,unused-ignore]
import torch
import torch.fx

from asyncgraph.compiled.delegate_support import (
    BuilderThread,
    first_line,
    mismatch,
    run_plain,
    same_tensors,
    timed_against_plain,
)
from asyncgraph.compiled.onnx_export import OnnxModel
from asyncgraph.kernels.base import KernelKind

LOG = logging.getLogger("asyncgraph.onnx")
MAX_SESSIONS = 2  # weights versions with a session: the one running and the next
BUILD_INLINE = False  # tests: sessions and checks on the calling thread, not the builder's
MAX_SIGNATURES = 256  # input signatures checked per segment; beyond, new ones stay plain
# Fixed-shape sessions: a dynamic segment's checked signature also gets a session with its
# symbolic dimensions fixed (add_free_dimension_override_by_name), which ONNX Runtime plans for
# that shape, which ran tiny BERT's batches faster
# (benchmarks/results/cpu/design_measurements.md#fixed-shape-sessions). Each pre-packs its own
# copy of the weights, so only segments with weights this small get them, and this many per version.
# A new weights version's session queues them again for the shapes that had them, each checked
# against the plain nodes on the new weights.
FIXED_SHAPE_SESSIONS = 8
FIXED_SHAPE_MAX_WEIGHT_BYTES = 64 << 20

# ONNX Runtime's graph optimisations that sessions run without. SkipLayerNormFusion: ONNX
# Runtime 1.32's CPU SkipLayerNormalization ran several times slower than the Add and
# LayerNormalization it replaces, and tiny BERT's session ran faster without it
# (benchmarks/results/cpu/design_measurements.md#skiplayernorm-fusion-disabled).
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
# and, for models with If, Loop or Scan nodes, ConstantFolding (onnx_export.CONTROL_FLOW)
CONTROL_FLOW_DISABLED = ("ConstantFolding",)

Signature = tuple[torch.Size, ...]


@dataclass(eq=False)
class _Session:
    """An InferenceSession whose initializers are one weights version's tensors."""

    weights: tuple[Any, ...]  # the tensors, held: their identities key the session
    run: Callable[..., Any]  # the session's run(output names, feeds, run options)
    session: Any
    arrays: tuple[Any, ...]  # what the initializers' memory belongs to
    # checked signatures' fixed-shape sessions, on the same weights
    fixed: dict[Signature, _Session] = field(default_factory=dict)


@dataclass
class _Check:
    """A signature's first call, to compare with the session's outputs."""

    inputs: tuple[Any, ...]  # copies of the runtime inputs, the weights themselves
    # the plain nodes' outputs; None: not known yet, the builder runs the plain nodes on
    # `inputs` first (a fixed-shape session rebuilt for new weights)
    expected: list[Any] | None


class OnnxDelegate:
    """One ONNX segment: the delegate node's target, called with all the segment's inputs
    (weights included) and returning its outputs as a list, like AOTIDelegate (a
    runtime/delegates.py Delegate)."""

    kernel_kind = KernelKind.DELEGATE

    def __init__(
        self, name: str, module: torch.fx.GraphModule, model: OnnxModel,
        node_names: Sequence[str], cost: int = 0, *, static: bool = False,
        weight_names: Sequence[str] = (), intra_op_threads: int = 1,
    ) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.module = module
        self.model = model
        self.node_names = tuple(node_names)
        self.cost = cost
        self.weight_names = tuple(weight_names)  # the baked inputs' names in the Weights
        self.intra_op_threads = intra_op_threads  # each session's (ExecutorConfig's count)
        # the runtime inputs come first, the baked weights after them (the pass orders them)
        self._split = model.baked.count(False)
        if model.baked != (False,) * self._split + (True,) * (len(model.baked) - self._split):
            raise ValueError(f"{name}: the runtime inputs must come before the weights")
        self._names = model.inputs[:self._split]
        self._outputs = list(model.outputs)
        self._static = static  # every runtime input's shape is fixed: one signature
        self._static_ok = False  # static, and that signature checked
        self._sessions: list[_Session] = []
        self._latest: _Session | None = None
        self._checked: dict[Signature, str] = {}  # "" ran as the plain nodes did, else why not
        self._pending_weights: list[tuple[Any, ...]] = []
        self._pending_checks: dict[Signature, _Check] = {}
        self._pending_fixed: list[tuple[_Session, Signature, _Check, dict[str, int]]] = []
        # the signatures given fixed-shape sessions (queued, at most FIXED_SHAPE_SESSIONS):
        # copies of their first call's runtime inputs and the sizes fixed, to queue them again
        # on each new weights version's session
        self._fixed_shapes: dict[Signature, tuple[tuple[Any, ...], dict[str, int]]] = {}
        self._builder = BuilderThread()  # makes sessions and checks, while there are some
        self._lock = self._builder.lock  # guards the pending work, sessions and the builder
        self.plain_calls = 0
        self.onnx_calls = 0
        self.sessions_built = 0
        self.fixed_calls = 0  # of onnx_calls, those a fixed-shape session ran
        self.fixed_sessions_built = 0  # fixed-shape sessions checked and kept, all versions
        self.unbuildable = ""  # why no session could be made (every call runs the fx module)
        # signature -> medians of the session's and the plain nodes' seconds (`_timed`)
        self.timed: dict[Signature, tuple[float, float]] = {}

    def __call__(self, *inputs: Any) -> list[Any]:
        session = self._latest
        split = self._split
        if session is not None and all(map(operator.is_, session.weights, inputs[split:])):
            if self._static:
                run = session.run if self._static_ok else None
            else:
                shapes = tuple([t.shape for t in inputs[:split]])
                fixed = session.fixed.get(shapes)
                if fixed is not None:
                    run = fixed.run
                    self.fixed_calls += 1
                elif self._checked.get(shapes) == "":
                    run = session.run
                else:
                    run = None
            if run is not None:
                try:
                    arrays = run(self._outputs,
                                 dict(zip(self._names, map(_NUMPY, inputs), strict=False)), None)
                except Exception:
                    signature = self._signature(inputs)
                    session.fixed.pop(signature, None)  # the general session decides
                    return self._careful(session, inputs, signature)
                self.onnx_calls += 1
                return list(map(torch.from_numpy, arrays))
        return self._other(inputs)

    def _other(self, inputs: Sequence[Any]) -> list[Any]:
        """A call that the latest session cannot answer: another weights version, or a
        signature not checked yet or refused."""
        weights = tuple(inputs[self._split:])
        signature = self._signature(inputs)
        status = self._checked.get(signature)
        session = self._session(weights)
        if session is not None and status == "":
            self._latest = session
            return self._careful(session, inputs, signature)
        outputs = self._plain(inputs)
        self.plain_calls += 1
        if status is None or (status == "" and session is None):
            self._request(weights, signature if status is None else None, inputs, outputs)
        return outputs

    def _careful(self, session: _Session, inputs: Sequence[Any],
                 signature: Signature) -> list[Any]:
        """A checked call, its inputs converted with care (a tensor that requires grad); when
        ONNX Runtime fails, the plain nodes run the call (raising the failing node's error)
        and, if they succeed, the signature stays plain from then on."""
        try:
            arrays = session.run(self._outputs, self._careful_feeds(inputs), None)
        except Exception as exc:
            outputs = self._plain(inputs)
            self.plain_calls += 1
            self._set(signature, "ONNX Runtime failed where the plain nodes did not: "
                                 f"{first_line(exc)}")
            return outputs
        self.onnx_calls += 1
        return [torch.from_numpy(a) for a in arrays]

    def _careful_feeds(self, inputs: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self._names, map(_array, inputs[:self._split]), strict=True))

    def _set(self, signature: Signature, status: str) -> None:
        self._checked[signature] = status
        if status:
            self._fixed_shapes.pop(signature, None)
            for session in self._sessions:
                session.fixed.pop(signature, None)
        if self._static:
            self._static_ok = status == ""

    def _plain(self, inputs: Sequence[Any]) -> list[Any]:
        """The plain nodes' outputs; their error, naming the failing node, when they fail."""
        return run_plain(self.module, inputs, self.__name__)

    def _signature(self, inputs: Sequence[Any]) -> Signature:
        if len(inputs) != len(self.model.inputs):
            raise TypeError(f"{self.__name__}: expected {len(self.model.inputs)} inputs, got "
                            f"{len(inputs)}")
        try:
            return tuple(t.shape for t in inputs[:self._split])
        except AttributeError:
            raise TypeError(f"{self.__name__}: expected {len(self.model.inputs)} tensor inputs, "
                            f"got {[type(v).__name__ for v in inputs]}") from None

    def _session(self, weights: tuple[Any, ...]) -> _Session | None:
        for session in self._sessions:
            if same_tensors(session.weights, weights):
                return session
        return None

    # -- the builder thread: sessions per weights version, checks per signature -------------

    def _request(self, weights: tuple[Any, ...], signature: Signature | None,
                 inputs: Sequence[Any], outputs: list[Any]) -> None:
        """Queue a session for `weights` (when none is made or queued) and the check of
        `signature` (when given and not queued), for the builder thread."""
        with self._lock:
            if self._builder.closed or self.unbuildable:
                return
            if self._session(weights) is None and not any(
                    same_tensors(w, weights) for w in self._pending_weights):
                self._pending_weights.append(weights)
            if (signature is not None and signature not in self._pending_checks
                    and len(self._checked) + len(self._pending_checks) < MAX_SIGNATURES):
                split = self._split
                self._pending_checks[signature] = _Check(
                    (*(v.clone() for v in inputs[:split]), *inputs[split:]),
                    [o.clone() for o in outputs])
            if self._builder.running or not (self._pending_weights or self._pending_checks):
                return
            if not BUILD_INLINE:
                if not self._builder.start(self._build_pending,
                                           f"asyncgraph-onnx-{self.__name__}"):
                    self._pending_weights.clear()  # no thread to be had: the call still
                    self._pending_checks.clear()  # succeeded
                return
            self._builder.claim()
        self._builder.run(self._build_pending)

    def _build_pending(self) -> None:
        """The builder thread: make the queued sessions, then check the queued signatures."""
        while True:
            with self._lock:
                if self._builder.closed or self.unbuildable or not (
                        self._pending_weights or self._pending_checks or self._pending_fixed):
                    self._pending_weights.clear()
                    self._pending_checks.clear()
                    self._pending_fixed.clear()
                    self._builder.finish()
                    return
                # sessions and checks first: fixed-shape sessions only make calls faster
                fixed = None if self._pending_weights or self._pending_checks else (
                    self._pending_fixed.pop(0))
                weights = self._pending_weights[0] if self._pending_weights else None
                check = None
                if weights is None and fixed is None:
                    signature, check = next(iter(self._pending_checks.items()))
                    weights = tuple(check.inputs[self._split:])
            if fixed is not None:
                self._build_fixed(*fixed)
                continue
            assert weights is not None
            session = self._session(weights) or self._build(weights)
            with self._lock:
                if check is None:
                    self._pending_weights.pop(0)
                    continue
                del self._pending_checks[signature]
            if session is not None:
                status = self._compare(session.run, check) or self._timed(
                    session.run, check, signature)
                self._set(signature, status)
                dimensions = self._fixed_dimensions(session, signature) if not status else {}
                if dimensions:
                    self._queue_fixed(session, signature, check, dimensions)

    def _build(self, weights: tuple[Any, ...]) -> _Session | None:
        """A session for `weights`, kept as the latest (the least recently made one dropped
        beyond MAX_SESSIONS); None, with `unbuildable` set, when ONNX Runtime refuses."""
        try:
            session = _make_session(self.model, self.model.inputs[self._split:], weights,
                                    self.intra_op_threads)
        except Exception as exc:
            self.unbuildable = first_line(exc)
            LOG.warning("%s stays plain: ONNX Runtime cannot load it: %s", self.__name__,
                        self.unbuildable)
            return None
        with self._lock:
            self._sessions = [*self._sessions, session][-MAX_SESSIONS:]
            self._latest = session
            self.sessions_built += 1
            self._pending_fixed.extend(self._fixed_again(session))
        return session

    def _queue_fixed(self, session: _Session, signature: Signature, check: _Check,
                     dimensions: dict[str, int]) -> None:
        """The builder thread, a signature just checked on `session`: queue its fixed-shape
        session on the latest session (only the latest's are called), and keep the signature
        for the sessions of later weights versions (`_fixed_again`)."""
        runtime = tuple(check.inputs[:self._split])
        with self._lock:
            if len(self._fixed_shapes) < FIXED_SHAPE_SESSIONS:
                self._fixed_shapes.setdefault(signature, (runtime, dimensions))
            latest = self._latest
            if latest is session:
                self._pending_fixed.append((session, signature, check, dimensions))
            elif latest is not None:  # checked on an older version's session
                self._pending_fixed.append(
                    (latest, signature, _Check((*runtime, *latest.weights), None), dimensions))

    def _fixed_again(self, session: _Session) -> list[
            tuple[_Session, Signature, _Check, dict[str, int]]]:
        """The fixed-shape sessions to build on a new weights version's `session`: one per
        signature that had one (or had one queued) on an earlier version and is still
        checked, each checked against the plain nodes run on the new weights (its _Check's
        `expected` is None until the builder runs them). Without this, a swap left every
        call on the general session for good."""
        return [(session, signature, _Check((*runtime, *session.weights), None), dimensions)
                for signature, (runtime, dimensions) in list(self._fixed_shapes.items())
                if self._checked.get(signature) == ""]

    def _fixed_dimensions(self, session: _Session, signature: Signature) -> dict[str, int]:
        """The sizes a checked signature's fixed-shape session fixes: the model's symbolic
        input dimensions in `signature`. {} when it gets none: a static segment, weights or
        sessions past FIXED_SHAPE_MAX_WEIGHT_BYTES or FIXED_SHAPE_SESSIONS, a dimension with
        no name to fix, or two inputs that disagree on one."""
        if self._static or len(session.fixed) >= FIXED_SHAPE_SESSIONS:
            return {}
        weight_bytes = sum(w.numel() * w.element_size() for w in session.weights
                           if isinstance(w, torch.Tensor))
        if weight_bytes > FIXED_SHAPE_MAX_WEIGHT_BYTES:
            return {}
        declared = {i.name: i.shape for i in session.session.get_inputs()}
        sizes: dict[str, int] = {}
        for name, shape in zip(self._names, signature, strict=True):
            dims = declared.get(name)
            if dims is None or len(dims) != len(shape):
                return {}
            for dim, size in zip(dims, shape, strict=True):
                if isinstance(dim, int):
                    continue
                if not isinstance(dim, str) or sizes.setdefault(dim, size) != size:
                    return {}
        return sizes

    def _build_fixed(self, session: _Session, signature: Signature, check: _Check,
                     dimensions: dict[str, int]) -> None:
        """The builder thread: a fixed-shape session for a checked signature, used once it
        gives the plain outputs for the signature's first call too (on `session`'s weights:
        the plain nodes run here first when the check has no outputs yet). Skipped when
        `session` is no longer the latest (a swap came first: the new one's session queued
        its own) or has FIXED_SHAPE_SESSIONS already."""
        if session is not self._latest or len(session.fixed) >= FIXED_SHAPE_SESSIONS:
            return
        where = [list(s) for s in signature]
        if check.expected is None:
            try:
                with torch.no_grad():
                    check = _Check(check.inputs, list(self.module(*check.inputs)))
            except Exception as exc:
                LOG.info("%s: no fixed-shape session for %s: the plain nodes failed on the "
                         "new weights: %s", self.__name__, where, first_line(exc))
                return
        try:
            fixed = _make_session(self.model, self.model.inputs[self._split:], session.weights,
                                  self.intra_op_threads, dimensions)
        except Exception as exc:
            LOG.info("%s: no fixed-shape session for %s: %s", self.__name__, where,
                     first_line(exc))
            self._fixed_shapes.pop(signature, None)  # ONNX Runtime would refuse it again
            return
        mismatch = self._compare(fixed.run, check)
        if mismatch:
            LOG.info("%s: the fixed-shape session for %s is not used: %s", self.__name__,
                     where, mismatch)
            return
        with self._lock:
            if self._checked.get(signature) == "" and session in self._sessions:
                session.fixed[signature] = fixed
                self.fixed_sessions_built += 1

    def _compare(self, run: Callable[..., Any], check: _Check) -> str:
        """"" when a session's `run` gives the plain outputs for the check's inputs, else
        why not."""
        inputs = check.inputs
        assert check.expected is not None
        try:
            arrays = run(self._outputs, self._careful_feeds(inputs), None)
        except Exception as exc:
            return f"ONNX Runtime failed: {first_line(exc)}"
        return mismatch([torch.from_numpy(a) for a in arrays], check.expected)

    def _timed(self, run: Callable[..., Any], check: _Check, signature: Signature) -> str:
        """"" when the session runs the check's inputs about as fast as the plain nodes or
        faster, else why the signature stays plain (delegate_support.py's
        `timed_against_plain`); the medians are kept for `statistics()`."""
        feeds = self._careful_feeds(check.inputs)
        with torch.inference_mode():  # as on the workers: the inputs may be inference tensors
            self.timed[signature], why = timed_against_plain(
                lambda: run(self._outputs, feeds, None), lambda: self._plain(check.inputs),
                "ONNX Runtime")
        return why

    def prepare_weights(self, tensors: Mapping[str, Any]) -> None:
        """A swap's new weights: start making their session now (the executor calls this
        before executions see them). Only when they are all named weights: folded values
        (`_folded.*`) are computed later, and their first call queues the session instead."""
        names = self.weight_names
        if not names or any(n not in tensors for n in names):
            return
        weights = tuple(tensors[n] for n in names)
        with self._lock:
            if self._builder.closed or self.unbuildable or any(
                    same_tensors(s.weights, weights) for s in self._sessions):
                return
        self._request(weights, None, (), [])

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued for the builder; False when `timeout` passed first."""
        return self._builder.wait_idle(timeout)

    async def aclose(self) -> None:
        """Drop the queued work and wait, without holding the loop, for what the builder is
        doing: a closed Executor leaves no builder thread behind."""
        await self._builder.aclose()

    def statistics(self) -> dict[str, Any]:
        refused = {str(tuple(tuple(s) for s in k)): v for k, v in self._checked.items() if v}
        return {"calls": self.onnx_calls + self.plain_calls, "onnx_calls": self.onnx_calls,
                "plain_calls": self.plain_calls,
                "sessions": len(self._sessions), "sessions_built": self.sessions_built,
                "fixed_shape_sessions": len(self._latest.fixed) if self._latest else 0,
                "fixed_shape_sessions_built": self.fixed_sessions_built,
                "fixed_calls": self.fixed_calls,
                "checked": sum(1 for v in self._checked.values() if not v),
                "refused": refused, "unbuildable": self.unbuildable,
                "pending": (len(self._pending_weights) + len(self._pending_checks)
                            + len(self._pending_fixed)),
                "nodes": len(self.node_names), "decomposed": self.model.decomposed,
                "intra_op_threads": self.intra_op_threads, "serves": self.serves()}

    def serves(self) -> dict[str, str]:
        """Per input signature checked: what runs it (ONNX Runtime or the plain nodes) and
        why."""
        if self.unbuildable:
            return {"*": f"plain: ONNX Runtime cannot load it: {self.unbuildable}"}
        said = {}
        for signature, status in self._checked.items():
            timed = self.timed.get(signature)
            measured = (f": {timed[0] * 1e6:.0f} us against the plain nodes' "
                        f"{timed[1] * 1e6:.0f} us" if timed else "")
            said[str([list(s) for s in signature])] = (f"plain: {status}" if status
                                                      else f"onnx{measured}")
        return said

    def __repr__(self) -> str:
        return f"OnnxDelegate({self.__name__}, {len(self.node_names)} nodes)"


def _make_session(
    model: OnnxModel, names: Sequence[str], weights: Sequence[Any], threads: int = 1,
    dimensions: dict[str, int] | None = None,
) -> _Session:
    """A session on `weights` (those of `names`, the baked inputs, that the model reads:
    OnnxModel.unread are not given); `dimensions`: symbolic input dimensions fixed to these
    sizes."""
    options = ort.SessionOptions()
    for dim, size in (dimensions or {}).items():
        options.add_free_dimension_override_by_name(dim, size)
    options.intra_op_num_threads = threads
    if threads > 1:  # its pool's threads sleep between runs: spinning, they took the cores
        # from other executions (benchmarks/results/cpu/design_measurements.md#no-spinning)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # no warnings about initializers its optimiser removed
    given = [(n, w) for n, w in zip(names, weights, strict=True) if n not in model.unread]
    arrays = tuple(_array(w.detach().contiguous()) for _, w in given)
    if given:
        options.add_external_initializers(
            [n for n, _ in given], [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])
    session = ort.InferenceSession(
        model.model, options, providers=["CPUExecutionProvider"],
        disabled_optimizers=[*DISABLED_OPTIMIZERS,
                             *(CONTROL_FLOW_DISABLED if model.control_flow else ())])
    inner = getattr(session, "_sess", None)  # the binding: no per-call input-name validation
    run = inner.run if inner is not None and hasattr(inner, "run") else session.run
    return _Session(tuple(weights), run, session, arrays)


# The smallest model ONNX Runtime loads: y = Identity(x), x float[1]. Made with
# `onnx.helper.make_model(make_graph([make_node("Identity", ["x"], ["y"])], "warm", ...),
# opset_imports=[make_opsetid("", 17)], ir_version=8).SerializeToString()`, written out here
# so that starting the runtime needs no `import onnx` (76 ms) in the serving process.
_IDENTITY_MODEL = (b"\x08\x08\x12\x00::\n\x10\n\x01x\x12\x01y\"\x08Identity\x12\x04warmZ\x0f\n"
                   b"\x01x\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08"
                   b"\x01\x12\x04\n\x02\x08\x01B\x04\n\x00\x10\x11")
_started = False


def start_runtime() -> None:
    """Start ONNX Runtime's process-wide state (its environment, kernel registries, thread
    pools), once per process, by making a session of an Identity model.

    Why: the first InferenceSession of a process takes 50-60 ms, most of it holding the
    GIL; made on a fast form's build thread while the loop served 64 callers, tiny BERT's
    stalled the loop for 25-34 ms, and 4-6 ms once this had run. An Executor that may build
    an ONNX form calls this when it is made, before it serves (plugins.py)."""
    global _started
    if not _started:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        ort.InferenceSession(_IDENTITY_MODEL, options, providers=["CPUExecutionProvider"])
        _started = True


_NUMPY = torch.Tensor.numpy


def _array(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    return tensor.detach().numpy() if tensor.requires_grad else tensor.numpy()
