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
    DEVICE: a kernel on an accelerator; its OpKernel's `device_type` ("cuda") names the device
        backend that plans it (runtime/device.py), which enqueues it on the device's queues.
    ASYNC: a coroutine function; awaited as a task on the event loop.
    DELEGATE: a whole compiled subprogram (AOTInductor, a remote model); runs on a worker.

    CUDA is a deprecated alias of DEVICE (the same member), kept for one release.
    """

    PRIM = "prim"
    CPU = "cpu"
    DEVICE = "device"
    CUDA = "device"  # deprecated alias of DEVICE: a kernel made with it is a "cuda" kernel
    ASYNC = "async"
    DELEGATE = "delegate"


#: The device type of a DEVICE kernel made without one: the one device kernels had before they
#: named their device (KernelKind.CUDA's callers).
DEFAULT_DEVICE_TYPE = "cuda"


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
    program was exported with; 0 when unknown or negligible. `device_type` is the device a
    DEVICE kernel runs on (torch's device type: "cuda"; DEFAULT_DEVICE_TYPE when not given),
    None for every other kind.
    """

    __slots__ = ("cost", "device_type", "fn", "kind", "name")

    def __init__(
        self,
        fn: Callable[..., Any],
        kind: KernelKind,
        name: str,
        cost: int = 0,
        *,
        device_type: str | None = None,
    ):
        if device_type is not None and kind is not KernelKind.DEVICE:
            raise ValueError(
                f"kernel {name!r} of kind {kind.value} names device_type {device_type!r}: "
                "only a KernelKind.DEVICE kernel runs on a device"
            )
        self.fn = fn
        self.kind = kind
        self.name = name
        self.cost = cost
        self.device_type = device_type or (
            DEFAULT_DEVICE_TYPE if kind is KernelKind.DEVICE else None
        )

    def with_fn(self, fn: Callable[..., Any]) -> OpKernel:
        """This kernel calling `fn` instead: a wrapper (fault injection, a test's gate) keeps
        what places the node, its kind, cost and device type."""
        return OpKernel(fn, self.kind, self.name, self.cost, device_type=self.device_type)

    @property
    def where(self) -> str:
        """What the kernel runs as, for people: its device type for a device kernel ("cuda"),
        else its kind ("cpu", "prim")."""
        return self.device_type or self.kind.value

    def __repr__(self) -> str:
        return f"OpKernel({self.name}, kind={self.where}, cost={self.cost})"
