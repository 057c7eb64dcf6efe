"""Scripted segments: runs of aten nodes run by TorchScript's C++ interpreter, no compile step.

Why: the plain graph calls each aten op through torch's Python binding (1.4-2 us of dispatch
an op on the development machine) with the GIL held, so unbatched executions use one core
however many callers wait. nativert calls its ops from C++. `ExecutorConfig(segments=
("script",))` (the segment backend "script", runtime/delegates.py) gives asyncgraph the same:
each long run of aten nodes (the segments of segments.py, as AOTInductor compiles them)
becomes one delegate node that calls a torch.jit.trace of the run,
which TorchScript's interpreter runs in C++ with the GIL released (tiny BERT of
benchmarks/nativert_compare.py: 0.56-0.83 ms a call against nativert's 0.66-1.12 ms, and two
threads run 1.2-1.9x one thread's calls, where the plain graph's do not gain).

A trace bakes in every shape it saw, so a delegate traces once per signature of its runtime
inputs (their shapes, dtypes and devices; weights keep theirs through a swap) and keeps up to
MAX_TRACES. That is exact only where no shape inside the run depends on tensor values: ops
with data-dependent output shapes (nonzero, unique, item) stay interpreted and split the runs,
and so do ops that write to their arguments and ops outside aten (custom torch.library ops,
whose Python kernels TorchScript's interpreter would call back into: not a path to trust
with a process's memory; a CI run saw an unexplained std::bad_alloc in one after them).
Weights are arguments of the trace, not constants, so `swap_weights` needs nothing here.

A new signature is traced on a thread of its own ("asyncgraph-trace-<segment>",
delegate_support.py's BuilderThread, shared with the ONNX delegate), never on the calling
thread: the trace and TorchScript's two warm-up runs take ~27 ms on tiny BERT
(~70 ms for the process's first trace), and a segment placed inline would otherwise hold the
event loop that long once per new shape (a batched program: once per batch size). Until the
trace is ready, calls of that signature run the segment's fx module, as they would without
scripting. The trace runs on copies of the first successful call's runtime inputs, so the
caller may reuse its tensors at once. A call that fails is run again node by node, so that
the error names the aten node that failed, and starts no trace; a run the tracer refuses
keeps running as its fx module, and `statistics()` says why. A trace is also timed against the
fx module on those inputs (delegate_support.py's `timed_against_plain`): where TorchScript's
call costs more than the nodes (a short segment, small shapes), the signature stays on the fx
module, and `statistics()["serves"]` says, per signature, which runs it and the medians
measured. The Executor's `aclose` waits for a trace in progress; `wait_idle` waits for all of
them.

torch.jit is deprecated from torch 2.13 (it warns on every trace; the warning is silenced
around ours). Where torch.jit.trace is gone, the pass leaves the graph as it is.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx

from asyncgraph.compiled.build import segment_module
from asyncgraph.compiled.delegate_support import (
    BuilderThread,
    first_line,
    run_nodes_naming_failure,
    run_plain,
    timed_against_plain,
)
from asyncgraph.compiled.segments import Segment, replace_segments, tensor_bounded_segments
from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, Node, TensorSpec
from asyncgraph.kernels.base import KernelKind
from asyncgraph.kernels.cost import estimate_cost

MAX_TRACES = 64  # signatures traced per segment (batch sizes 1-64); beyond, the oldest is dropped
MIN_NODES = 8  # a run this long is scripted (the call into TorchScript costs ~10-20 us)
# TorchScript's profiling executor profiles a new trace's first call and optimises on its
# second (tiny BERT: 7 and 8 ms, then 0.7): both are made at trace time, so the calls that
# adaptive placement times are already the steady ones.
WARM_UP_CALLS = 2

Signature = tuple[tuple[torch.Size, torch.dtype, torch.device], ...]
_TRACE = cast(Callable[..., Any], getattr(torch.jit, "trace", None))  # None: torch.jit gone


class ScriptedDelegate:
    """One scripted segment: the delegate node's target, called with all the segment's inputs
    (weights included) and returning its outputs as a list, like AOTIDelegate (a
    runtime/delegates.py Delegate)."""

    kernel_kind = KernelKind.DELEGATE

    def __init__(
        self, name: str, module: torch.fx.GraphModule, runtime: Sequence[int],
        node_names: Sequence[str], cost: int = 0, max_traces: int = MAX_TRACES,
    ) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.module = module
        self.runtime = tuple(runtime)  # the inputs that are not weights: a trace's signature
        self.node_names = tuple(node_names)
        self.cost = cost
        self.max_traces = max_traces
        # signature -> what runs it: its trace, or the fx module (why in `_plain`)
        self._traces: OrderedDict[Signature, Callable[..., Any]] = OrderedDict()
        self._plain: dict[Signature, str] = {}  # why the fx module runs a traced signature
        # signature -> medians of the trace's and the fx module's seconds (`_timed`)
        self.timed: dict[Signature, tuple[float, float]] = {}
        # signatures waiting for a trace: inputs, and the caller's inference and grad modes
        self._pending: dict[Signature, tuple[tuple[Any, ...], bool, bool]] = {}
        self._tracer = BuilderThread()  # the tracer thread, while there are traces to make
        self._lock = self._tracer.lock  # guards the two dicts and the tracer thread
        self.calls = 0
        self.untraced_calls = 0  # calls the fx module ran while their trace was pending
        self.traced = 0
        self.dropped = 0
        self.untraceable = ""  # why the tracer refused a signature (its calls run the fx module)

    def __call__(self, *inputs: Any) -> list[Any]:
        signature = self._signature(inputs)
        run = self._traces.get(signature)
        self.calls += 1
        if run is None:  # raises the failing node's error, naming the node
            outputs = run_plain(self.module, inputs, self.__name__)
            self.untraced_calls += 1
            self._request_trace(signature, inputs)
            return outputs
        try:
            return list(run(*inputs))
        except Exception:
            run_nodes_naming_failure(self.module, inputs, self.__name__)  # a trace names none
            raise

    def _signature(self, inputs: Sequence[Any]) -> Signature:
        try:
            return tuple((t.shape, t.dtype, t.device) for t in map(inputs.__getitem__,
                                                                   self.runtime))
        except (AttributeError, IndexError):
            raise TypeError(
                f"{self.__name__}: expected {len(self.module.graph.find_nodes(op='placeholder'))}"
                f" tensor inputs, got {[type(v).__name__ for v in inputs]}"
            ) from None

    def _request_trace(self, signature: Signature, inputs: Sequence[Any]) -> None:
        """Queue a trace of `signature` for the tracer thread, which starts when none runs."""
        with self._lock:
            if (self._tracer.closed or signature in self._traces or signature in self._pending
                    or len(self._pending) >= self.max_traces):
                return
            runtime = set(self.runtime)
            copies = tuple(v.clone() if k in runtime else v for k, v in enumerate(inputs))
            self._pending[signature] = (
                copies, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
            if not self._tracer.start(self._trace_pending, f"asyncgraph-trace-{self.__name__}"):
                del self._pending[signature]  # no thread to be had: the call still succeeded

    def _trace_pending(self) -> None:
        """The tracer thread: trace the pending signatures in order, then end."""
        while True:
            with self._lock:
                if self._tracer.closed or not self._pending:
                    self._pending.clear()
                    self._tracer.finish()
                    return
                signature, (inputs, inference, grad) = next(iter(self._pending.items()))
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                run, why = self._trace(inputs)
                if not why:
                    run, why = self._timed(run, signature, inputs)
            with self._lock:
                if len(self._traces) >= self.max_traces:
                    dropped, _ = self._traces.popitem(last=False)
                    self._plain.pop(dropped, None)
                    self.timed.pop(dropped, None)
                    self.dropped += 1
                self._traces[signature] = run
                if why:
                    self._plain[signature] = why
                del self._pending[signature]

    def _trace(self, inputs: tuple[Any, ...]) -> tuple[Callable[..., Any], str]:
        """A warmed-up trace of the module on `inputs` (which it ran without error) and "",
        or the fx module and why when the tracer refuses."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecation (2.13), tracer warnings
                run = _TRACE(self.module, inputs, check_trace=False)
            for _ in range(WARM_UP_CALLS):
                run(*inputs)
        except Exception as exc:  # its message may be empty: first_line still names it
            self.untraceable = first_line(exc)
            return self.module, f"the tracer refused: {self.untraceable}"
        self.traced += 1
        return cast(Callable[..., Any], run), ""

    def _timed(self, run: Callable[..., Any], signature: Signature,
               inputs: tuple[Any, ...]) -> tuple[Callable[..., Any], str]:
        """The trace and "" when it runs `inputs` about as fast as the fx module or faster,
        else the fx module and why (`timed_against_plain`); the medians kept for
        `statistics()`."""
        self.timed[signature], why = timed_against_plain(
            lambda: run(*inputs), lambda: self.module(*inputs), "TorchScript")
        return (self.module, why) if why else (run, "")

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no trace is pending; False when `timeout` passed first. For threads
        and tests: on the event loop, poll `statistics()["pending"]` or await `aclose`."""
        return self._tracer.wait_idle(timeout)

    def prepare_weights(self, tensors: Mapping[str, Any]) -> None:
        """Nothing to prepare for a swap: weights are arguments of the traces."""

    async def aclose(self) -> None:
        """Drop the pending traces and wait, without holding the loop, for the one in
        progress: a closed Executor leaves no tracer thread behind."""
        await self._tracer.aclose()

    def statistics(self) -> dict[str, Any]:
        return {"calls": self.calls, "untraced_calls": self.untraced_calls,
                "traced": self.traced, "pending": len(self._pending),
                "signatures": len(self._traces), "dropped": self.dropped,
                "untraceable": self.untraceable, "nodes": len(self.node_names),
                "serves": self.serves()}

    def serves(self) -> dict[str, str]:
        """Per input signature traced: what runs it (its trace or the plain nodes) and why."""
        said = {}
        for signature in list(self._traces):  # the tracer thread may add one meanwhile
            timed = self.timed.get(signature)
            why = self._plain.get(signature)
            key = str([f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {device}"
                       for shape, dtype, device in signature])
            said[key] = (f"plain: {why}" if why else
                         f"script: {timed[0] * 1e6:.0f} us against the plain nodes' "
                         f"{timed[1] * 1e6:.0f} us" if timed else "script")
        return said

    def __repr__(self) -> str:
        return f"ScriptedDelegate({self.__name__}, {len(self.node_names)} nodes)"


def unscriptable_reason(node: Node) -> str | None:
    """Why a node segments.py accepts must still stay out of a trace, or None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "aten":  # a torch.library op's Python kernel, called from C++
        return f"{target} is not an aten op"
    if (torch.Tag.dynamic_output_shape in target.tags
            or torch.Tag.data_dependent_output in target.tags):
        return f"{target}: its output's shape or value depends on tensor values"
    if target._schema.is_mutable:  # the warm-up calls of a new trace would write twice
        return f"{target} writes to its arguments"
    return None


def script_segments(graph: Graph, min_nodes: int | None = None) -> tuple[Graph, list[str]]:
    """`graph` with each run of at least `min_nodes` (MIN_NODES) scriptable aten nodes replaced
    by a ScriptedDelegate node (and getitems of its outputs), and the delegates' names."""
    if _TRACE is None:
        return graph, []
    min_nodes = MIN_NODES if min_nodes is None else min_nodes
    segments = tensor_bounded_segments(
        graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec),
        {n.index for n in graph.nodes if unscriptable_reason(n) is not None},
        min_nodes=min_nodes)
    weights = {s.value for s in graph.signature.inputs if s.kind in WEIGHT_KINDS}

    def delegate(segment: Segment) -> tuple[str, ScriptedDelegate]:
        name = f"scripted_segment_{segment.index}"
        nodes = segment.nodes(graph)
        return name, ScriptedDelegate(
            name, segment_module(graph, segment, names=True),
            [k for k, v in enumerate(segment.inputs) if v not in weights],
            [n.name for n in nodes], sum(estimate_cost(n, graph) for n in nodes))

    if not segments:
        return graph, []
    return (replace_segments(graph, segments, delegate),
            [f"scripted_segment_{s.index}" for s in segments])

