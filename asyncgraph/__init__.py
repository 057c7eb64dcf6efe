"""asyncgraph: run dataflow graphs - above all torch.export programs - from async Python.

    async with asyncgraph.Executor(exported_program) as ex:
        out = await ex.execute(x)
"""

from asyncgraph.builder import GraphBuilder
from asyncgraph.config import BatchingConfig, ExecutorConfig
from asyncgraph.errors import (
    AsyncGraphError,
    ExecutorClosedError,
    GraphValidationError,
    InputValidationError,
    ProgramLoadError,
    UnsupportedOpsError,
    WeightsError,
)
from asyncgraph.executor import Executor, ExecutorStatistics, load
from asyncgraph.frame import ExecutionFrame
from asyncgraph.graph import Graph, Node, Ref, Signature, Value
from asyncgraph.importers import Program, to_program
from asyncgraph.plan import ExecutionPlan, Placement
from asyncgraph.pool import FramePool, FramePoolStatistics
from asyncgraph.weights import Weights

__version__ = "0.1.0"

__all__ = [
    "AsyncGraphError",
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
