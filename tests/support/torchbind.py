"""torch's torchbind test class `_TorchScriptTesting::_TensorQueue`, for tests of script objects.

torch.testing._internal.torchbind_impls loads the same library, but through common_utils,
which needs `expecttest` (not a dependency here); so this loads `libtorchbind_test.so` from
torch's own lib folder and registers the fake class and fake ops export traces with.
`SKIP_REASON` is None when the class is available, else why not (the tests skip with it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

QUALNAME = "_TorchScriptTesting::_TensorQueue"


def _load() -> str | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorchbind_test.so")
    if not os.path.exists(path):
        return f"torch {torch.__version__} ships no libtorchbind_test.so (torchbind's test class)"
    try:
        torch.ops.load_library(path)
    except Exception as exc:  # pragma: no cover - a broken install
        return f"cannot load {path}: {exc}"
    from torch._library.fake_class_registry import has_fake_class

    if not has_fake_class(QUALNAME):
        torch._library.register_fake_class(QUALNAME)(FakeTensorQueue)
        for name, fake in (("queue_pop", lambda tq: tq.pop()),
                           ("queue_push", lambda tq, x: tq.push(x)),
                           ("queue_size", lambda tq: tq.size())):
            torch.library.register_fake(f"_TorchScriptTesting::{name}")(fake)
    return None


class FakeTensorQueue:
    """What export traces a _TensorQueue as: a Python list of (fake) tensors."""

    def __init__(self, queue: list[Any]) -> None:
        self.queue = queue

    @classmethod
    def __obj_unflatten__(cls, ctx: Any) -> FakeTensorQueue:
        return cls(**dict(ctx))

    def push(self, x: Any) -> None:
        self.queue.append(x)

    def pop(self) -> Any:
        return self.queue.pop(0)

    def size(self) -> int:
        return len(self.queue)


SKIP_REASON = _load()


def tensor_queue(*tensors: torch.Tensor) -> Any:
    """A fresh _TensorQueue holding `tensors`, first in first out."""
    queue = torch.classes._TorchScriptTesting._TensorQueue(torch.empty(0).fill_(-1))
    for t in tensors:
        queue.push(t)
    return queue
