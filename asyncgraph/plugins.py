"""What the layers above the runtime give it: the tracer and the optional segment passes.

The runtime defines the hooks (runtime/instrument.py, runtime/extensions.py) and never imports
what plugs into them; this module, run by `import asyncgraph`, plugs in tools/trace.py's
TraceRecorder (ExecutorConfig.trace), compiled/scripted.py's `script_segments`
(ExecutorConfig.script_segments, imported when an Executor first asks for it: torch.jit on
demand) and compiled/onnx_segments.py's `onnx_segments` (ExecutorConfig.onnx_segments: ONNX
Runtime and the exporter on demand, from the optional `asyncgraph[onnxruntime]` extra).
Each is imported when first used, so `import asyncgraph` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncgraph.runtime.extensions import GraphPass, register_pass
from asyncgraph.runtime.instrument import Instrument, register_tracer

if TYPE_CHECKING:
    from asyncgraph.graph.ir import Graph

ONNX_EXTRA = "pip install 'asyncgraph[onnxruntime]'"


def _trace_recorder(graph: Graph) -> Instrument:
    from asyncgraph.tools.trace import TraceRecorder  # torch on demand

    return TraceRecorder(graph)


def _script_segments() -> GraphPass:
    from asyncgraph.compiled.scripted import script_segments  # torch.jit on demand

    return lambda graph, _config: script_segments(graph)


def _onnx_segments() -> GraphPass:
    try:
        from asyncgraph.compiled.onnx_segments import onnx_segments  # onnxruntime on demand
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise ImportError(
            f"ExecutorConfig(onnx_segments=True) needs onnxruntime, onnx and onnxscript "
            f"({missing} is missing): {ONNX_EXTRA}", name=exc.name) from exc
    # one thread unless the user sets a count: each session's pool is its own, and spins
    return lambda graph, config: onnx_segments(
        graph, intra_op_threads=config.intra_op_threads or 1)


register_tracer(_trace_recorder)
register_pass("script_segments", _script_segments)
register_pass("onnx_segments", _onnx_segments)
