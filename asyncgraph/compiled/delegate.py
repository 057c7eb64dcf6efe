"""AOTIDelegate: one compiled segment, called by the scheduler like any kernel.

The delegate node's target. KernelFactory gives it an OpKernel of kind DELEGATE (it sees
`kernel_kind`), which the plan places on a worker thread: the segment holds many nodes' work,
and the AOTI runner releases the GIL while it runs. Its arguments are the segment's inputs,
weights included, read from the execution's frame; it returns the segment's outputs as a list
that operator.getitem nodes take apart.

Weights are arguments, not constants baked into the compiled model (see asyncgraph/compiled/
__init__.py for why): so a swap needs no recompile and no constant-buffer update, and each
execution runs on the weights version it started with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncgraph.kernels.base import KernelKind


class AOTIDelegate:
    """Calls one AOTInductor model (an AOTIModelPackageLoader) on a segment's inputs.

    `contiguous[i]` says whether input i was contiguous when the segment was compiled: the
    compiled code assumes the strides it saw, so an input that is not (a swapped weight made
    with .t(), a sliced user input) is made contiguous first rather than read wrongly.
    """

    kernel_kind = KernelKind.DELEGATE

    def __init__(
        self, name: str, loader: Any, contiguous: Sequence[bool], node_names: Sequence[str],
        cost: int = 0,
    ) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.loader = loader
        self.contiguous = tuple(contiguous)
        self.node_names = tuple(node_names)
        self.cost = cost
        self.calls = 0

    def __call__(self, *inputs: Any) -> list[torch.Tensor]:
        if len(inputs) != len(self.contiguous):
            raise TypeError(
                f"{self.__name__}: expected {len(self.contiguous)} inputs, got {len(inputs)}"
            )
        args = [
            t.contiguous() if want and isinstance(t, torch.Tensor) and not t.is_contiguous()
            else t
            for t, want in zip(inputs, self.contiguous, strict=True)
        ]
        self.calls += 1
        outputs: list[torch.Tensor] = self.loader.run(args)
        return outputs

    def statistics(self) -> dict[str, Any]:
        """Calls so far and the nodes this segment replaces."""
        return {"name": self.__name__, "calls": self.calls, "nodes": len(self.node_names)}

    def __repr__(self) -> str:
        return f"<AOTIDelegate {self.__name__}: {len(self.node_names)} nodes>"
