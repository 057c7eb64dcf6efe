"""asyncgraph: run dataflow graphs - above all torch.export programs - from async Python.

    async with asyncgraph.Executor(exported_program) as ex:
        out = await ex.execute(x)
"""

from asyncgraph import plugins as _plugins  # noqa: F401 - the tracer, the scripted pass
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
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.importers import Program, to_program
from asyncgraph.graph.ir import Graph, Node, Ref, Signature, Value
from asyncgraph.loading import load
from asyncgraph.runtime.config import BatchingConfig, ExecutorConfig
from asyncgraph.runtime.executor import Executor, ExecutorStatistics
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.pool import FramePool, FramePoolStatistics
from asyncgraph.runtime.weights import Weights

__version__ = "0.1.0"

__all__ = [
    "AsyncGraphError",
    "BatchCancelledError",
    "BatchingConfig",
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
    "to_program",
]
