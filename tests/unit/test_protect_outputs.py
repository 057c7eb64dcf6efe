"""FrameStreams.protect_outputs on CUDA tensors, without a GPU.

An execution's outputs were made on the executor's streams; the caller uses them on its own
current stream. protect_outputs records that stream on each CUDA output tensor (nested in
tuples, lists and dicts too) so the caching allocator cannot hand their memory back to our
streams while the caller still reads them. test_streams.py covers the CPU no-op; here a tensor
subclass that reports a CUDA device stands in for real CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncgraph.cuda.device import CudaRuntime
from asyncgraph.cuda.streams import Role, plan_streams


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:`index` (None: the current device)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    cuda_index: int | None = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.cuda_index)


def fake_cuda(index: int | None) -> FakeCudaTensor:
    tensor = torch.ones(2).as_subclass(FakeCudaTensor)
    tensor.cuda_index = index
    return tensor


class RecordingBackend:
    """Streams are names; the calling thread's current stream differs from the default one."""

    def __init__(self) -> None:
        self.recorded: list[tuple[Any, str]] = []

    def new_stream(self, device: int) -> str:
        return f"ours{device}"

    def new_event(self) -> object:
        return object()

    def host_streams(self, device: int) -> list[str]:
        return [f"current{device}", f"default{device}"]

    def record_stream(self, value: Any, stream: str) -> None:
        self.recorded.append((value, stream))


def test_protect_outputs_records_the_callers_current_stream_on_each_cuda_tensor() -> None:
    backend = RecordingBackend()
    plan = plan_streams([[]], [Role.CUDA], 1, outputs=[0])
    runtime = CudaRuntime(plan, [0], max_stream_sets=1, backend=backend)  # type: ignore[arg-type]
    state = runtime.frame_state([lambda values: None])
    on_one, on_zero, on_current, in_dict = fake_cuda(1), fake_cuda(0), fake_cuda(None), fake_cuda(1)
    state.protect_outputs([torch.ones(3), on_one, (on_zero, 7), [on_current], {"k": in_dict}])
    recorded = [(id(tensor), stream) for tensor, stream in backend.recorded]
    assert recorded == [
        (id(on_one), "current1"),
        (id(on_zero), "current0"),
        (id(on_current), "current0"),
        (id(in_dict), "current1"),
    ]
