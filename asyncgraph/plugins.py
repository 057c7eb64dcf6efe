"""What the layers above the runtime give it: the tracer, the devices and the segment backends.

The runtime defines the hooks (runtime/instrument.py, runtime/device.py, runtime/delegates.py)
and never imports what plugs into them; this module, run by `import asyncgraph`, plugs in
tools/trace.py's TraceRecorder (ExecutorConfig.trace), cuda/backend.py's CudaBackend as the
device type "cuda" (imported when a program first has CUDA nodes), and the segment backends
`ExecutorConfig.segments` names:
"script" (compiled/scripted.py, torch.jit on demand) and "onnx" (compiled/onnx_segments.py:
ONNX Runtime and the exporter on demand, from the optional `asyncgraph[onnxruntime]` extra).
Each is imported when an Executor first asks for it, so `import asyncgraph` imports no torch.
A new delegate backend is one more `register_backend` here (or in the package that brings
it): nothing in runtime/ changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncgraph.runtime.delegates import SegmentBackend, SegmentPlanner, register_backend
from asyncgraph.runtime.device import DeviceBackend, DeviceKind, register_device
from asyncgraph.runtime.instrument import Instrument, register_tracer

if TYPE_CHECKING:
    from asyncgraph.graph.ir import Graph

ONNX_EXTRA = "pip install 'asyncgraph[onnxruntime]'"


def _trace_recorder(graph: Graph) -> Instrument:
    from asyncgraph.tools.trace import TraceRecorder  # torch on demand

    return TraceRecorder(graph)


def _cuda_backend() -> DeviceBackend:
    from asyncgraph.cuda.backend import CUDA  # cuda/ (and torch) on demand

    return CUDA


def _script_planner() -> SegmentPlanner:
    from asyncgraph.compiled.scripted import script_segments  # torch.jit on demand

    return lambda graph, _config: script_segments(graph)


def _onnx_planner() -> SegmentPlanner:
    try:
        from asyncgraph.compiled.onnx_segments import onnx_segments  # onnxruntime on demand
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise ImportError(
            f"ExecutorConfig(segments=('onnx',)) needs onnxruntime, onnx and onnxscript "
            f"({missing} is missing): {ONNX_EXTRA}", name=exc.name) from exc
    # one thread unless the user sets a count: each session's pool is its own, and spins
    return lambda graph, config: onnx_segments(
        graph, intra_op_threads=config.intra_op_threads or 1)


def _onnx_missing() -> str | None:
    """What the ONNX backend needs that is not installed (found without importing it)."""
    from importlib.util import find_spec

    absent = [m for m in ("onnxruntime", "onnx", "onnxscript") if find_spec(m) is None]
    return f"{', '.join(absent)} not installed: {ONNX_EXTRA}" if absent else None


register_tracer(_trace_recorder)
register_device(DeviceKind(
    "cuda", _cuda_backend,
    dispatch_keys=("CUDA", "SparseCUDA", "SparseCsrCUDA", "QuantizedCUDA", "NestedTensorCUDA"),
))
register_backend(SegmentBackend("script", _script_planner))
register_backend(SegmentBackend("onnx", _onnx_planner, fast_form=True, missing=_onnx_missing))
