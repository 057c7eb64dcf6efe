"""The device seam (runtime/device.py): what the Executor asks of a device plan, on the
simulated GPU of support/cuda_graph_fake.py and on a CPU-only program."""

from __future__ import annotations

import pytest
import torch

from asyncgraph import Executor, GraphBuilder
from asyncgraph.cuda.backend import CudaPlans
from asyncgraph.graph.importers import to_program
from asyncgraph.graph.ir import Graph, Node
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.testing import LeakChecker
from tests.support.cuda_graph_fake import CaptureGpu, diamond_program, make_executor, running

aten = torch.ops.aten


async def test_device_statistics_are_the_device_plans_statistics(
    leak_check: LeakChecker,
) -> None:
    gpu = CaptureGpu(seed=1)
    ex = make_executor(diamond_program(torch.tensor([2.0, -1.0, 0.5, 3.0])), gpu,
                       graph_warmup=1)
    async with running(ex, gpu):
        for k in range(3):
            await ex.execute(torch.linspace(-1.0, 1.0, 4) * (k + 1))
        stats = ex.device_statistics()
        assert stats is not None and stats.captures == 1 and stats.replays == 1, stats
        assert stats == ex.cuda_graph_statistics()  # the older name reads the same
    assert isinstance(ex._device, CudaPlans)  # the "cuda" backend's plan, by the registry


async def test_a_cpu_program_has_no_device_plan(leak_check: LeakChecker) -> None:
    b = GraphBuilder()
    b.output(b.call(aten.relu.default, b.input("x"), name="relu"))
    async with Executor(b.build()) as ex:
        assert (await ex.execute(torch.tensor([-1.0, 2.0]))).tolist() == [0.0, 2.0]
        assert ex.device_statistics() is None and ex.stream_plan is None


class DeviceTyped(KernelFactory):
    """Builder graphs' kernels, with each node named `<type>_...` (mps, xpu) a device kernel
    of that device type."""

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        device_type = node.name.split("_")[0]
        if kernel is not None and device_type in ("mps", "xpu"):
            return OpKernel(kernel.fn, KernelKind.DEVICE, kernel.name, cost=1000,
                            device_type=device_type)
        return kernel


def test_the_executor_asks_the_backend_of_its_kernels_device_type() -> None:
    """The device type comes from the kernels, not from a name the runtime knows: a program of
    "mps" kernels asks the registry for "mps" (none is registered here)."""
    b = GraphBuilder()
    b.output(b.call(aten.relu.default, b.input("x"), name="mps_relu"))
    with pytest.raises(LookupError, match=r"no device backend for device type 'mps'"):
        Executor(b.build(), kernel_factory=DeviceTyped())


def test_a_program_on_two_device_types_is_refused_naming_them() -> None:
    b = GraphBuilder()
    x = b.call(aten.relu.default, b.input("x"), name="mps_relu")
    b.output(b.call(aten.neg.default, x, name="xpu_neg"))
    with pytest.raises(ValueError, match=r"device types 'mps' \(node mps_relu\) and 'xpu' "
                                         r"\(node xpu_neg\)"):
        Executor(b.build(), kernel_factory=DeviceTyped())


def test_a_device_registered_with_its_dispatch_keys_gets_device_kernels() -> None:
    """A device package brings its torch dispatch keys with its registration (runtime/
    device.py's DeviceKind): nodes on that device then get DEVICE kernels of its type, and
    the core names no device but the CPU. Unregistered, they are CPU kernels again."""
    from asyncgraph.kernels.factory import _keys_of
    from asyncgraph.runtime.device import DeviceKind, register_device, unregister_device

    def load() -> object:
        raise AssertionError("not planned in this test")

    assert _keys_of("meta") is None
    register_device(DeviceKind("meta", load, dispatch_keys=("Meta",)))  # type: ignore[arg-type]
    try:
        keys = _keys_of("meta")
        assert keys is not None and keys[0] == "Meta" and "CompositeImplicitAutograd" in keys
        ep = torch.export.export(_Relu(), (torch.empty(2, 3, device="meta"),))
        graph = to_program(ep).graph
        (kernel,) = KernelFactory().create(graph)
        assert (kernel.kind, kernel.device_type) == (KernelKind.DEVICE, "meta")
    finally:
        unregister_device("meta")
    assert _keys_of("meta") is None
    (kernel,) = KernelFactory().create(graph)
    assert (kernel.kind, kernel.device_type) == (KernelKind.CPU, None)
    assert _keys_of("cuda") is not None  # cuda's, registered by `import asyncgraph`


class _Relu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)
