"""Device: what the run loop asks of a frame's device state, without knowing what is behind it.

A frame of a program with device nodes holds one (`ExecutionFrame.gpu`); cuda/device.py's
FrameStreams implements it for CUDA, and the frame never imports cuda/. Per loaded schedule the
device gives the frame its unit tables (`unit_tables`: the call and the placement of every
unit, in which device units enqueue on the device's queues, CUDA's streams, and units that
read device values are Placement.HOST_WAIT); per execution the scheduler calls `begin`,
`host_ready`/`wait_host` before a HOST_WAIT unit, and `await finish()`; the Executor calls
`protect_outputs` on what it hands to the caller. A frame whose executions are captured
whole as CUDA graphs also has `ExecutionFrame.graphs` (`Captures`: cuda/graphs.py's
FrameGraphs, which leases the Executor's graph instances; `DevicePlan.captures_whole` says
so, and the Executor then runs its executions in Mode.CAPTURED).

The seam to the device packages (anyio's backend seam: the interfaces live here, the backends
are registered by name and imported when first used, the runtime never imports one): a
`DeviceBackend` plans a program's device side into a `DevicePlan` (its runs, the nodes that
never fuse, the groups captured as one unit, each frame's state, moving inputs, close,
statistics). Backends are registered by device type (`register_device`; asyncgraph/plugins.py,
run by `import asyncgraph`, registers cuda/'s as "cuda"), and runtime/build.py asks
`device_backend(t)` only for a program with device nodes (KernelKind.DEVICE kernels, placed
Placement.DEVICE), `t` their kernels' `device_type` ("cuda"), so a CPU-only program imports
nothing of cuda/. The core types name a device, not CUDA: adding a device kind is its package
and one `register_device` call (and, for the aten ops the KernelFactory makes, its row of
dispatch keys in kernels/factory.py, which picks the device type from the node's tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # `import asyncgraph` registers devices here without importing torch
    from asyncgraph.graph.ir import Graph, ValueSpec
    from asyncgraph.kernels import OpKernel
    from asyncgraph.runtime.config import ExecutorConfig
    from asyncgraph.runtime.plan import ExecutionPlan, Placement

Calls = tuple[Callable[[list[Any]], Any], ...]

RunKey = tuple[int, int]
"""What consecutive device nodes share to fuse into one run (cuda/: (device, stream))."""

ALIAS_KEY: RunKey = (-1, -1)
"""The run key of an inline alias node (getitem, tuple packing): it continues an open device
run; it runs on the host in nanoseconds and would otherwise split runs after every tuple op."""


class DeviceRuns(Protocol):
    """How a program's device nodes fuse into runs, and the calls a run's compiled code
    makes around each node (cuda/streams.py's StreamPlan). A run's function is
    `unit(v, g, s)`: `v` the frame's values, `g` the frame's Device, `s` the run's stream."""

    def run_key(self, node: int, placement: Placement) -> RunKey | None:
        """The key of the device run node `node` may join when placed `placement`, ALIAS_KEY
        for an alias that continues one, None when it joins none."""
        ...

    def before_node(self, node: int) -> list[str]:
        """Statements of a run's code before node `node`'s kernel."""
        ...

    def after_node(self, node: int, value: Callable[[int], str]) -> list[str]:
        """Statements after it; `value(p)` is the expression of node p's value."""
        ...


class UnitSchedule(Protocol):
    """What a device reads of a Schedule (schedule.py) to build its unit tables."""

    @property
    def calls(self) -> Calls: ...

    @property
    def where(self) -> tuple[Placement, ...]: ...

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def segments(self) -> tuple[int, ...]: ...


class Device(Protocol):
    """A frame's device state, reused by the frame's executions (one at a time)."""

    weights_version: int  # the loaded execution's weights (ExecutionFrame.load sets it)

    def unit_tables(self, schedule: UnitSchedule) -> tuple[Calls, tuple[int, ...]]:
        """The calls and placements of `schedule`'s units on this device (kept per schedule)."""
        ...

    def begin(self) -> None:
        """Start an execution (loop thread)."""
        ...

    def host_ready(self, node: int) -> bool:
        """Whether the device values host node `node` reads are ready (never waits)."""
        ...

    async def wait_host(self, node: int) -> None:
        """Await, without blocking the loop, the device values host node `node` reads."""
        ...

    async def finish(self) -> None:
        """Await the end of the execution's device work."""
        ...

    def protect_outputs(self, outputs: Sequence[Any]) -> None:
        """Make outputs safe to use on the caller's side."""
        ...


class Captures(Protocol):
    """A frame's captured executions (cuda/graphs.py)."""

    async def run(self, frame: Any, flat: list[Any], signature: Any, version: int) -> bool:
        """Run the loaded frame as a capture or replay; False: it takes the dataflow."""
        ...


class DevicePlan(Protocol):
    """One program's device side as its backend planned it, shared by all its executions
    (cuda/backend.py's CudaPlans)."""

    @property
    def runs(self) -> DeviceRuns:
        """How the program's device nodes fuse into runs."""
        ...

    @property
    def unfusable(self) -> Sequence[bool]:
        """Per node: never fused (a host node reading device values may have to wait)."""
        ...

    def atomic_groups(self) -> tuple[tuple[int, ...], dict[int, int]] | None:
        """Groups of nodes each run as one unit (captured segments): a topological order in
        which each group is contiguous, and node -> group; None when there are none."""
        ...

    @property
    def captures_whole(self) -> bool:
        """Whether executions may be captured whole (Mode.CAPTURED: the frames' Captures
        replay them); segments captured inside the dataflow do not count."""
        ...

    def frame_state(self, calls: Calls) -> tuple[Device, Captures | None]:
        """A new frame's device state and its captures (None: nothing captured)."""
        ...

    def move_inputs(self, flat: Sequence[Any], specs: Sequence[ValueSpec | None]) -> list[Any]:
        """The inputs moved to the devices their specs name (`move_inputs_to_device=True`)."""
        ...

    def admits(self) -> bool:
        """Whether the event loop has room for one more execution's fixed host work in this
        iteration (cuda/: the loop's LoopBudget), taking it; when not, the Executor awaits
        `admit` before the execution starts (holding its frame)."""
        ...

    async def admit(self) -> None:
        """Return once a later iteration has room for the execution (`admits` said no)."""
        ...

    async def warm_up(
        self, examples: Sequence[tuple[list[Any], Any]], template: list[Any], version: int
    ) -> list[Any]:
        """Capture ahead, off the loop, what executions of each example will replay
        (`Executor.warm_up`): `examples` are flat inputs with their signature (None when
        validation made none), `template` the weights of `version` in their slots. Returns
        once the captures end, where each signature stands (cuda/: SignatureCapture); []
        when the device captures nothing ahead."""
        ...

    async def stop(self) -> None:
        """The Executor is closing, every frame idle: stop the device's own background work
        (captures ahead) and wait for it, before `close`."""
        ...

    def close(self) -> None:
        """The Executor is closed and every frame idle: free what the plan holds."""
        ...

    def statistics(self) -> Any:
        """What the device side did (cuda/: CudaGraphStatistics)."""
        ...


class DeviceBackend(Protocol):
    """A device kind's planner (cuda/backend.py's CudaBackend)."""

    def plan(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        kernels: Sequence[OpKernel],
        config: ExecutorConfig,
        driver: object | None = None,
    ) -> DevicePlan:
        """The device side of a program with nodes on this device. `driver` replaces the
        device's library (Executor's `_cuda_backend`: tests simulate a GPU with it)."""
        ...


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """A device backend by device type: `load()` imports its package and returns it;
    `dispatch_keys`, the device's torch dispatch keys, its backend's first (("CUDA",
    "SparseCUDA", ...)): the aten ops with a kernel for one of them get device kernels
    (kernels/factory.py's `_keys_of`)."""

    type: str
    load: Callable[[], DeviceBackend]
    dispatch_keys: tuple[str, ...] = ()


_DEVICES: dict[str, DeviceKind] = {}


def register_device(kind: DeviceKind) -> None:
    """Make programs with nodes on device type `kind.type` plannable; replaces a kind of the
    same type."""
    _DEVICES[kind.type] = kind


def unregister_device(device_type: str) -> None:
    """Forget the device kind `device_type`; no error if unknown."""
    _DEVICES.pop(device_type, None)


def dispatch_keys(device_type: str) -> tuple[str, ...]:
    """The torch dispatch keys of registered device type `device_type`; () when unknown
    (kernels/factory.py asks, through `device_dispatch_keys`, which the Executor sets)."""
    kind = _DEVICES.get(device_type)
    return kind.dispatch_keys if kind is not None else ()


def registered_devices() -> tuple[str, ...]:
    """The registered device types, sorted."""
    return tuple(sorted(_DEVICES))


def device_backend(device_type: str) -> DeviceBackend:
    """The backend of `device_type`, imported now; LookupError naming the registered ones."""
    kind = _DEVICES.get(device_type)
    if kind is None:
        known = ", ".join(repr(t) for t in registered_devices()) or "none (import asyncgraph)"
        raise LookupError(
            f"no device backend for device type {device_type!r}; registered: {known} (a "
            "device package registers itself with asyncgraph.runtime.device.register_device)"
        )
    return kind.load()


def move_inputs_to_device(flat: Sequence[Any], specs: Sequence[ValueSpec | None]) -> list[Any]:
    """Move tensor inputs to the device their spec names (`move_inputs_to_device=True`).

    Copies to a GPU are enqueued on the caller's current stream without a host wait
    (`non_blocking`); the device's frame state (cuda/: `FrameStreams.begin`) orders the
    execution's streams after them. Copies to the CPU block until the data has arrived: a
    non-blocking one would hand CPU kernels a tensor the GPU may still be writing, and nothing
    would order them after it. Device-neutral (only `Tensor.to`): a CPU-only program moves its
    inputs with it too, without a device backend.
    """
    import torch  # this module is imported by `import asyncgraph`, which imports no torch

    from asyncgraph.graph.ir import TensorSpec

    out = list(flat)
    for i, (value, spec) in enumerate(zip(flat, specs, strict=True)):
        if not isinstance(spec, TensorSpec) or not isinstance(value, torch.Tensor):
            continue
        want = spec.device
        if value.device.type != want.type or (
            want.index is not None and value.device.index != want.index
        ):
            out[i] = value.to(want, non_blocking=want.type == "cuda")
    return out
