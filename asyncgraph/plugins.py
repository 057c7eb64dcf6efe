"""What the layers above the runtime give it: the tracer, the devices and the segment backends.

The runtime defines the hooks (runtime/instrument.py, runtime/device.py, runtime/delegates.py)
and never imports what plugs into them; this module, run by `import asyncgraph`, plugs in
tools/trace.py's TraceRecorder (ExecutorConfig.trace), cuda/backend.py's CudaBackend as the
device type "cuda" (imported when a program first has CUDA nodes), and the segment backends
`ExecutorConfig.segments` names:
"script" (compiled/scripted.py, torch.jit on demand) and "onnx" (compiled/onnx_segments.py:
ONNX Runtime and the exporter on demand, from the optional `asyncgraph[onnxruntime]` extra),
and "aoti", which plans no segments but builds the default path's AOTInductor form
(compiled/aoti_form.py; off with ASYNCGRAPH_AOTI_FORM=0).
Each is imported when an Executor first asks for it, so `import asyncgraph` imports no torch.
A new delegate backend is one more `register_backend` here (or in the package that brings
it): nothing in runtime/ changes.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

from asyncgraph.runtime.delegates import SegmentBackend, SegmentPlanner, register_backend
from asyncgraph.runtime.device import DeviceBackend, DeviceKind, register_device
from asyncgraph.runtime.disk_cache import cache_root
from asyncgraph.runtime.instrument import Instrument, register_tracer

if TYPE_CHECKING:
    from asyncgraph.graph.ir import Graph
    from asyncgraph.runtime.config import ExecutorConfig

ONNX_EXTRA = "pip install 'asyncgraph[onnxruntime]'"
AOTI_ENV = "ASYNCGRAPH_AOTI_FORM"  # 0: no AOTInductor form (no compile started)


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
    absent = _onnx_absent()  # onnx and onnxscript load only when a segment is exported
    if absent:
        raise ImportError(_onnx_needs(absent), name=absent[0])
    try:
        from asyncgraph.compiled.export_cache import environment
        from asyncgraph.compiled.onnx_delegate import start_runtime
        from asyncgraph.compiled.onnx_segments import onnx_segments  # onnxruntime on demand
    except ImportError as exc:
        raise ImportError(_onnx_needs([exc.name or str(exc)]), name=exc.name) from exc
    start_runtime()  # once per process: its first session holds the GIL for tens of ms
    environment()  # the export cache's versions, read once (importlib.metadata: ms of Python)
    # one thread unless the user sets a count: each session's pool is its own, and spins
    return lambda graph, config: onnx_segments(
        graph, intra_op_threads=config.intra_op_threads or 1)


def _aoti_planner() -> SegmentPlanner:
    from asyncgraph.compiled import aoti_form  # noqa: F401 - its imports at start-up

    def refuse(_graph: Graph, _config: ExecutorConfig) -> tuple[Graph, list[str]]:
        raise ValueError(
            "ExecutorConfig(segments=('aoti',)): the 'aoti' backend builds the default path's "
            "AOTInductor form (ExecutorConfig.fast_paths), not segments; for compiled segments "
            "compile a package: asyncgraph compile model.pt2 -o model.aoti.pt2")

    return refuse


def _aoti_form(program: Any, threads: int, runners: int) -> Any:
    from asyncgraph.compiled.aoti_form import form_program

    return form_program(program, threads, runners)


def _aoti_missing() -> str | None:
    """Why the AOTInductor form cannot be built here, or None (nothing imported)."""
    if os.environ.get(AOTI_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"turned off by {AOTI_ENV}=0"
    if sys.platform != "linux":
        return "AOTInductor forms are built on Linux only"
    if cache_root() is None:
        return "the disk cache is off (ASYNCGRAPH_CACHE_DIR=): a compile is kept only there"
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) for AOTInductor"
    return None


def _onnx_needs(absent: list[str]) -> str:
    return (f"ExecutorConfig(segments=('onnx',)) needs onnxruntime, onnx and onnxscript "
            f"({', '.join(absent)} is missing): {ONNX_EXTRA}")


def _onnx_absent() -> list[str]:
    """The modules the ONNX backend needs that cannot be imported, found without importing
    them (an import that a test or the application blocked counts as absent)."""
    from importlib.util import find_spec

    absent = []
    for name in ("onnxruntime", "onnx", "onnxscript"):
        try:
            if name in sys.modules:
                found = sys.modules[name] is not None
            else:
                found = find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def _onnx_missing() -> str | None:
    """Why the ONNX backend cannot build a fast form here, or None."""
    absent = _onnx_absent()
    return f"{', '.join(absent)} not installed: {ONNX_EXTRA}" if absent else None


register_tracer(_trace_recorder)
register_device(DeviceKind(
    "cuda", _cuda_backend,
    dispatch_keys=("CUDA", "SparseCUDA", "SparseCsrCUDA", "QuantizedCUDA", "NestedTensorCUDA"),
))
# Fast forms are tried in registration order, the first that builds serving (runtime/forms.py):
# ONNX Runtime's first (the fastest measured on every model), then the scripted segments, which
# need nothing installed: a program that ONNX cannot export still gets a form to measure.
register_backend(SegmentBackend("onnx", _onnx_planner, fast_form=True, missing=_onnx_missing))
register_backend(SegmentBackend("script", _script_planner, fast_form=True))
# Then, as one more candidate beside whichever of those built, the AOTInductor form: the whole
# program compiled in a child process (the first time: 16-60 s of idle CPU), cached on disk.
register_backend(SegmentBackend("aoti", _aoti_planner, fast_form=True, missing=_aoti_missing,
                                form_program=_aoti_form, form_threads=(1,)))
