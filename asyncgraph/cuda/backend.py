"""The "cuda" device backend: what the runtime's device seam (runtime/device.py) gets of cuda/.

The runtime never imports this package: asyncgraph/plugins.py registers `CudaBackend` as the
device type "cuda", and runtime/build.py asks the registry for it only when a program has CUDA
nodes (KernelKind.DEVICE kernels of device type "cuda", placed DEVICE), so a CPU-only program
never imports cuda/ or touches torch.cuda.
`CudaBackend.plan` makes the device plans, in this order: the streams (streams.py), the stream
sets of all executions (device.py's CudaRuntime), whether executions are captured whole
(capturable.py), otherwise the segments captured (segments.py), and the frame-side capture
state (capture.py, graphs.py). `CudaPlans` is the `DevicePlan` the Executor keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from asyncgraph.cuda.capturable import CapturePlan, plan_capture
from asyncgraph.cuda.capture import CudaGraphs, CudaGraphStatistics, SignatureCapture
from asyncgraph.cuda.device import Backend, CudaRuntime, FrameStreams
from asyncgraph.cuda.graphs import FrameGraphs, frame_captures, warm_up
from asyncgraph.cuda.segments import SegmentPlan, segment_plan_for
from asyncgraph.cuda.streams import StreamPlan, stream_plan_for
from asyncgraph.graph.ir import Graph, ValueSpec
from asyncgraph.kernels import OpKernel
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.device import Calls, move_inputs_to_device
from asyncgraph.runtime.plan import ExecutionPlan


@dataclass(slots=True)
class CudaPlans:
    """The device side of a program with CUDA nodes (docs/gpu.md): a DevicePlan."""

    stream_plan: StreamPlan
    runtime: CudaRuntime  # the stream sets of all executions
    graph_plan: CapturePlan  # whether executions are captured whole, and why not
    segment_plan: SegmentPlan  # otherwise the segments captured, and the nodes left out
    graphs: CudaGraphs  # the frame-side state factory of both

    @property
    def runs(self) -> StreamPlan:
        """One stream's consecutive CUDA nodes fuse into one run."""
        return self.stream_plan

    @property
    def unfusable(self) -> Sequence[bool]:
        """A CPU node reading GPU values may have to wait for them: it is never fused."""
        return self.runtime.needs_host_wait

    def atomic_groups(self) -> tuple[tuple[int, ...], dict[int, int]] | None:
        """Each captured segment is one unit of the schedule (segments.py)."""
        segments = self.segment_plan
        return (segments.order, segments.segment_of) if segments.segments else None

    @property
    def captures_whole(self) -> bool:
        """Executions captured whole (graphs.py), not only segments."""
        return self.graph_plan.capturable

    def frame_state(self, calls: Calls) -> tuple[FrameStreams, FrameGraphs | None]:
        """A frame's GPU state (events made once, reused by its executions) and captures."""
        gpu = self.runtime.frame_state(calls)
        return gpu, frame_captures(self.graphs, gpu)

    def move_inputs(self, flat: Sequence[Any], specs: Sequence[ValueSpec | None]) -> list[Any]:
        """Copies to a GPU enqueue on the caller's stream; FrameStreams.begin orders after."""
        return move_inputs_to_device(flat, specs)

    def admits(self) -> bool:
        """An execution's fixed host work takes the loop's slice (cuda/loop_charges.py)."""
        return self.runtime.charges.admits()

    async def admit(self) -> None:
        await self.runtime.charges.admit()

    async def warm_up(
        self, examples: Sequence[tuple[list[Any], Any]], template: list[Any], version: int
    ) -> list[SignatureCapture]:
        """Capture each example's signature's graph instances ahead, on a thread, and return
        where each stands (graphs.py's `warm_up`); [] when executions are not captured whole
        (segments are captured inside executions, per frame)."""
        if not self.captures_whole:
            return []
        return await warm_up(self.graphs, examples, template, version)

    async def stop(self) -> None:
        """Stop the captures ahead and wait for the running one (before `close`)."""
        await self.graphs.stop()

    def close(self) -> None:
        """Free every frame's graphs and pools; the host-wait thread ends once nothing waits."""
        self.graphs.close()
        self.runtime.close()

    def statistics(self) -> CudaGraphStatistics:
        """Captures, replays and fallbacks of CUDA graphs."""
        return self.graphs.statistics()


class CudaBackend:
    """The device backend of type "cuda" (runtime/device.py's DeviceBackend)."""

    def plan(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        kernels: Sequence[OpKernel],
        config: ExecutorConfig,
        driver: object | None = None,
    ) -> CudaPlans:
        """The device plans of a program with CUDA nodes; `driver`, a `Backend` replacing
        torch.cuda (tests' simulated GPU), or None for torch.cuda."""
        stream_plan = stream_plan_for(
            graph, plan, config.cuda.streams, costs=[float(k.cost) for k in kernels],
            captured=config.cuda.graphs,  # inside graphs, smaller branches overlap
        )
        runtime = CudaRuntime(
            stream_plan, plan.outputs,
            max_stream_sets=config.max_concurrent_executions,
            backend=cast("Backend | None", driver),  # a Protocol: duck-typed, as before
            loop_slice_s=config.loop_slice_s,
        )
        graph_plan = plan_capture(graph, plan, stream_plan, kernels, config)
        segment_plan = segment_plan_for(graph_plan, graph, stream_plan, kernels, config)
        graphs = CudaGraphs(graph_plan, runtime, graph, plan, config, segment_plan)
        return CudaPlans(stream_plan, runtime, graph_plan, segment_plan, graphs)


CUDA = CudaBackend()
