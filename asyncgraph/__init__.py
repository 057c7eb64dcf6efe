"""asyncgraph: run dataflow graphs - above all torch.export programs - from async Python.

    async with asyncgraph.Executor(exported_program) as ex:
        out = await ex.execute(x)

The public names are imported on first use (PEP 562), so `import asyncgraph` and the modules
that need no torch (the errors, the command line's `--help` and `--version`) do not import
torch; `asyncgraph.Executor` and the rest import it when first read.
"""

from typing import TYPE_CHECKING, Any

from asyncgraph import plugins as _plugins  # noqa: F401 - the tracer, the segment backends
from asyncgraph.errors import (
    AsyncGraphError,
    BatchCancelledError,
    ExecutorClosedError,
    GraphValidationError,
    InputValidationError,
    OverloadedError,
    ProgramLoadError,
    UnsupportedOpsError,
    WeightsError,
)

if TYPE_CHECKING:
    from asyncgraph.graph.builder import GraphBuilder
    from asyncgraph.graph.importers import Program, to_program
    from asyncgraph.graph.ir import Graph, Node, Ref, Signature, Value
    from asyncgraph.loading import load, save
    from asyncgraph.runtime.config import BatchingConfig, CudaConfig, ExecutorConfig
    from asyncgraph.runtime.executor import Executor, ExecutorStatistics
    from asyncgraph.runtime.frame import ExecutionFrame
    from asyncgraph.runtime.plan import ExecutionPlan, Placement
    from asyncgraph.runtime.pool import FramePool, FramePoolStatistics
    from asyncgraph.runtime.weights import Weights

__version__ = "0.1.0"

# name -> the module it is imported from on first use
_LAZY = {
    "GraphBuilder": "asyncgraph.graph.builder",
    "Program": "asyncgraph.graph.importers",
    "to_program": "asyncgraph.graph.importers",
    "Graph": "asyncgraph.graph.ir",
    "Node": "asyncgraph.graph.ir",
    "Ref": "asyncgraph.graph.ir",
    "Signature": "asyncgraph.graph.ir",
    "Value": "asyncgraph.graph.ir",
    "load": "asyncgraph.loading",
    "save": "asyncgraph.loading",
    "BatchingConfig": "asyncgraph.runtime.config",
    "CudaConfig": "asyncgraph.runtime.config",
    "ExecutorConfig": "asyncgraph.runtime.config",
    "Executor": "asyncgraph.runtime.executor",
    "ExecutorStatistics": "asyncgraph.runtime.executor",
    "ExecutionFrame": "asyncgraph.runtime.frame",
    "ExecutionPlan": "asyncgraph.runtime.plan",
    "Placement": "asyncgraph.runtime.plan",
    "FramePool": "asyncgraph.runtime.pool",
    "FramePoolStatistics": "asyncgraph.runtime.pool",
    "Weights": "asyncgraph.runtime.weights",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncgraph' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AsyncGraphError",
    "BatchCancelledError",
    "BatchingConfig",
    "CudaConfig",
    "ExecutionFrame",
    "ExecutionPlan",
    "Executor",
    "ExecutorClosedError",
    "ExecutorConfig",
    "ExecutorStatistics",
    "FramePool",
    "FramePoolStatistics",
    "Graph",
    "GraphBuilder",
    "GraphValidationError",
    "InputValidationError",
    "Node",
    "OverloadedError",
    "Placement",
    "Program",
    "ProgramLoadError",
    "Ref",
    "Signature",
    "UnsupportedOpsError",
    "Value",
    "Weights",
    "WeightsError",
    "load",
    "save",
    "to_program",
]
