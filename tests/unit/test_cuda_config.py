"""CudaConfig, ExecutorConfig's nested CUDA settings (asyncgraph/runtime/config.py), and the
core types that name a device instead of CUDA (KernelKind.DEVICE, Placement.DEVICE).

The flat spellings (`cuda_streams`, `cuda_graphs`, `cuda_graph_warmup`) stay accepted for one
release: they warn, naming the new spelling, and map into `cuda`; reading them gives `cuda`'s
values without a warning, so unconverted readers keep working. `dataclasses.replace` goes
through the same constructor, so it maps and warns the same and never undoes a new `cuda`.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch

from asyncgraph import ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.runtime.config import CudaConfig
from asyncgraph.runtime.plan import Placement, build_plan


def test_cuda_config_defaults() -> None:
    cuda = CudaConfig()
    assert (cuda.streams, cuda.graphs, cuda.graph_warmup) == (None, False, 2)  # None: auto
    assert ExecutorConfig().cuda == cuda


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"streams": 0}, "streams must be >= 1 or None (CUDA streams per device for one "
                         "execution), got 0"),
        ({"graph_warmup": -1}, "graph_warmup must be >= 0 (executions of a signature before "
                               "its capture), got -1"),
    ],
)
def test_cuda_config_refuses_a_bad_value_naming_its_field(
    kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        CudaConfig(**kwargs)
    assert str(err.value) == message


def test_cuda_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CudaConfig().streams = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("flat", "value", "field"),
    [("cuda_streams", 2, "streams"), ("cuda_graphs", True, "graphs"),
     ("cuda_graph_warmup", 0, "graph_warmup")],
)
def test_a_deprecated_flat_field_warns_and_maps_into_cuda(
    flat: str, value: object, field: str
) -> None:
    with pytest.warns(DeprecationWarning) as warned:
        config = ExecutorConfig(**{flat: value})  # type: ignore[arg-type]
    assert [str(w.message) for w in warned] == [
        f"ExecutorConfig({flat}={value!r}) is deprecated: use cuda=CudaConfig({field}={value!r})"]
    assert getattr(config.cuda, field) == value
    assert config.cuda == dataclasses.replace(CudaConfig(), **{field: value})


def test_deprecated_flat_fields_merge_into_a_given_cuda() -> None:
    with pytest.warns(DeprecationWarning) as warned:
        config = ExecutorConfig(  # type: ignore[call-arg]
            cuda=CudaConfig(streams=2), cuda_graphs=True, cuda_graph_warmup=0)
    assert config.cuda == CudaConfig(streams=2, graphs=True, graph_warmup=0)
    assert len(warned) == 2


def test_a_deprecated_flat_field_out_of_range_is_refused_by_cuda_configs_check() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(
        ValueError, match=r"^streams must be >= 1 .*got 0$"
    ):
        ExecutorConfig(cuda_streams=0)  # type: ignore[call-arg]


def test_the_flat_names_read_cuda_without_a_warning() -> None:
    config = ExecutorConfig(cuda=CudaConfig(streams=3, graphs=True, graph_warmup=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = (config.cuda_streams, config.cuda_graphs, config.cuda_graph_warmup)
    assert flat == (3, True, 5)
    with pytest.raises((AttributeError, TypeError)):  # a slots dataclass's frozen setattr
        config.cuda_streams = 1  # type: ignore[misc]


def test_executor_config_with_cuda_round_trips() -> None:
    cuda = CudaConfig(streams=1, graphs=True, graph_warmup=0)
    config = ExecutorConfig(cuda=cuda, max_parallel_ops=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither replace nor pickling passes a flat name
        assert dataclasses.replace(config).cuda == cuda
        assert dataclasses.replace(config, max_parallel_ops=1).cuda == cuda
        assert pickle.loads(pickle.dumps(config)) == config
        # a new `cuda` is what the copy has: the old flat values are not passed back in
        assert dataclasses.replace(config, cuda=CudaConfig()).cuda == CudaConfig()
    assert "cuda" in {f.name for f in dataclasses.fields(ExecutorConfig)}
    assert not {"cuda_streams", "cuda_graphs", "cuda_graph_warmup"} & {
        f.name for f in dataclasses.fields(ExecutorConfig)}


def test_replace_with_a_flat_name_warns_and_maps() -> None:
    config = ExecutorConfig(cuda=CudaConfig(streams=2))
    warning = (r"^ExecutorConfig\(cuda_graphs=True\) is deprecated: "
               r"use cuda=CudaConfig\(graphs=True\)$")
    with pytest.warns(DeprecationWarning, match=warning):
        graphs = dataclasses.replace(config, cuda_graphs=True)  # type: ignore[call-arg]
    assert graphs.cuda == CudaConfig(streams=2, graphs=True)


def test_kernel_kind_cuda_is_a_deprecated_alias_of_device() -> None:
    assert KernelKind.CUDA is KernelKind.DEVICE
    assert [k.name for k in KernelKind] == ["PRIM", "CPU", "DEVICE", "ASYNC", "DELEGATE"]


def test_a_device_kernel_names_its_device_type() -> None:
    def fn() -> None: ...

    assert OpKernel(fn, KernelKind.DEVICE, "k", device_type="mps").device_type == "mps"
    # made as KernelKind.CUDA kernels were, without a device type: a CUDA kernel
    assert OpKernel(fn, KernelKind.CUDA, "k").device_type == "cuda"
    assert OpKernel(fn, KernelKind.CPU, "k").device_type is None
    with pytest.raises(ValueError, match=r"kernel 'k' of kind cpu .* device_type 'cuda'"):
        OpKernel(fn, KernelKind.CPU, "k", device_type="cuda")


def test_a_wrapped_kernel_keeps_its_device_type() -> None:
    def fn() -> None: ...

    def wrapper() -> None: ...

    kernel = OpKernel(fn, KernelKind.DEVICE, "k", 7, device_type="mps")
    wrapped = kernel.with_fn(wrapper)
    assert (wrapped.fn, wrapped.kind, wrapped.name, wrapped.cost, wrapped.device_type) == (
        wrapper, KernelKind.DEVICE, "k", 7, "mps")


def test_placement_stream_is_a_deprecated_alias_of_device() -> None:
    assert Placement.STREAM is Placement.DEVICE
    assert Placement.DEVICE == 3 and Placement.HOST_WAIT == 4  # unit tables store the ints


@pytest.mark.parametrize(("device", "kind", "device_type"), [
    ("cuda", KernelKind.DEVICE, "cuda"),
    ("cpu", KernelKind.CPU, None),
    ("meta", KernelKind.CPU, None),  # a device without a row of dispatch keys: as before
])
def test_the_factory_names_the_device_type_of_an_aten_node(
    device: str, kind: KernelKind, device_type: str | None
) -> None:
    """The device type is the node's tensors' (kernels/factory.py), placed DEVICE."""
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(torch.ops.aten.add.Tensor, x, x, name="add"))  # a composite kernel
    spec = TensorSpec(torch.float32, torch.device(device), (4,), (1,))
    built = b.build()
    graph = Graph([dataclasses.replace(v, spec=spec) for v in built.values], list(built.nodes),
                  built.signature)
    (kernel,) = KernelFactory().create(graph)
    assert (kernel.kind, kernel.device_type) == (kind, device_type)
    plan = build_plan(graph, [kernel], ExecutorConfig())
    assert (plan.placement[0] is Placement.DEVICE) is (kind is KernelKind.DEVICE)
