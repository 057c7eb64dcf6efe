"""OpKernel: something callable for one node, and the kind the scheduler places it by."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncgraph.graph.importers import Program


class KernelKind(enum.Enum):
    """What a kernel is, which decides where the scheduler may run it.

    PRIM: structural and symbolic ops (getitem, sym arithmetic, asserts); microseconds, any thread.
    CPU: a torch or Python kernel on the CPU; inline when cheap, on a worker thread when heavy.
    CUDA: a kernel on a CUDA device; enqueued on a stream (see the GPU issue).
    ASYNC: a coroutine function; awaited as a task on the event loop.
    DELEGATE: a whole compiled subprogram (AOTInductor, a remote model); runs on a worker.
    """

    PRIM = "prim"
    CPU = "cpu"
    CUDA = "cuda"
    ASYNC = "async"
    DELEGATE = "delegate"


class KernelConfig(Protocol):
    """What the kernels read of the runtime's configuration (runtime/config.py's
    ExecutorConfig), which they otherwise hand on to their subgraphs' executors."""

    @property
    def fast_bindings(self) -> bool: ...


class InnerExecutor(Protocol):
    """What a control-flow kernel needs of the executor that runs one of its subgraphs."""

    plan: Any
    config: Any

    async def execute(self, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


# Makes the executor of a subgraph from the outer configuration (None: the defaults): passed
# in by the runtime (runtime/executor.py), so the kernels never import the executor that
# imports them.
InnerExecutorFactory = Callable[["Program", "KernelConfig | None"], InnerExecutor]


class OpKernel:
    """The callable for one node: `fn(*args, **kwargs)` with the node's bound arguments.

    `cost` is an estimate of the work (multiply-adds or elements touched) from the shapes the
    program was exported with; 0 when unknown or negligible.
    """

    __slots__ = ("cost", "fn", "kind", "name")

    def __init__(self, fn: Callable[..., Any], kind: KernelKind, name: str, cost: int = 0):
        self.fn = fn
        self.kind = kind
        self.name = name
        self.cost = cost

    def __repr__(self) -> str:
        return f"OpKernel({self.name}, kind={self.kind.value}, cost={self.cost})"
