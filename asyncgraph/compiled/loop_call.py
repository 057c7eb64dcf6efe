"""Calls of a small compiled segment made on an event loop's thread go through torch's binding.

The native container (native_call.py) releases the GIL while the model runs, so a segment on a
worker thread runs beside the loop and the other workers. The release costs Python on every
call: a new AtenTensorHandle per input (a pybind call, then a ctypes read of its capsule), the
ctypes call, then a ctypes capsule per output and a pybind call to steal them back. On the
event loop's own thread the release buys nothing: the loop waits for the result either way,
and torch's binding (AOTIModelPackageLoader.run) does the same work in C++.

Measured in place, on an 8-layer MLP compiled into one segment the native call spent longer
on handles and stealing than the segment's own run, and through the binding on the loop the
whole execution was faster than natively, in the same process
(benchmarks/results/cpu/design_measurements.md#small-segments-through-the-binding).

The binding is a second container, with its own copy of the constants (folded ones included),
and each load of it keeps ~0.34 MB the process never gets back (native_call's docstring). So
only a segment whose constants take at most LOOP_BINDING_MAX_BYTES gets one: at batch 1 such a
model reads its weights in about 100 us or less, where the call's fixed cost is a sixth of the
run or more. A larger model gains nothing and loses under load: tiny BERT paired (2.1 MB of
constants, a 340 us run; its binding grew the process by 4.6 MB) took 612 against 592 us at
batch 1, and 64 callers got 0.66x ONNX Runtime's throughput against 0.99x, since a run on the
loop then holds the GIL that the workers need between their runs.
ASYNCGRAPH_AOTI_CALL=native-only calls every segment natively.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch

from asyncgraph.compiled.native_call import NativeContainer

__all__ = ["LOOP_BINDING_MAX_BYTES", "LoopBindingContainer", "wants_loop_binding"]

LOOP_BINDING_MAX_BYTES = 1 << 20

_running_loop = asyncio.events._get_running_loop  # C: None on a thread without a running loop


def wants_loop_binding(native: NativeContainer, mode: str) -> bool:
    """Whether a segment's native container gets torch's binding beside it for calls on the
    loop (`mode`: ASYNCGRAPH_AOTI_CALL's value)."""
    return mode != "native-only" and native.constant_bytes <= LOOP_BINDING_MAX_BYTES


class LoopBindingContainer:
    """A native container and torch's binding of the same model holding the same constants:
    a call on a thread running an asyncio event loop goes through the binding, any other
    through the native container. The two agree bit for bit (CheckedContainer checked the
    model's first call). A swap loads both."""

    def __init__(self, native: NativeContainer, binding: Any) -> None:
        self.native: Any = native
        self.binding = binding
        self._fqns = native.get_constant_fqns()

    @property
    def kind(self) -> str:
        if self.native is self.binding:
            return "binding (swapped on a model without a copy update: torch 2.11)"
        return "native, torch's binding on the event loop's thread"

    def run(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        if _running_loop() is None:
            outputs: list[torch.Tensor] = self.native.run(args)
            return outputs
        outputs = self.binding.run(args)
        return outputs

    def load_constants(self, tensors: Mapping[str, torch.Tensor], *flags: bool) -> None:
        """Load `tensors` (fqn -> tensor) into both; no call runs on either (the delegate's
        guarantee for a load). A torch 2.11 model's native container cannot take the copy
        (NativeContainer.load_constants would make a binding of its own): it goes, and the
        binding runs every call from then on, as a lone native container's swap would do."""
        self.binding.load_constants(dict(tensors), *flags)
        if self.native is self.binding:
            return
        if not self.native.swaps_natively:
            self.native = self.binding
            return
        self.native.load_constants(tensors, *flags)

    def get_constant_fqns(self) -> list[str]:
        return list(self._fqns)
