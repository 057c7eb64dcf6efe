"""torch's torchbind test class `_TorchScriptTesting::_TensorQueue`, for tests of script objects.

torch.testing._internal.torchbind_impls.init_torchbind_implementations loads the library
through common_utils, which needs `expecttest` (not a dependency here); so this loads
`libtorchbind_test.so` from torch's own lib folder, then registers torch's fake classes and
fake ops (export traces with them; the ops insist their fakes live in torchbind_impls).
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
        from torch._library.fake_class_registry import has_fake_class
        from torch.testing._internal import torchbind_impls

        if not has_fake_class(QUALNAME):
            torchbind_impls.register_fake_operators()
            torchbind_impls.register_fake_classes()
    except Exception as exc:  # pragma: no cover - a torch without them
        return f"cannot set up torchbind's test classes from {path}: {exc!r}"
    return None


SKIP_REASON = _load()


def tensor_queue(*tensors: torch.Tensor) -> Any:
    """A fresh _TensorQueue holding `tensors`, first in first out."""
    queue = torch.classes._TorchScriptTesting._TensorQueue(torch.empty(0).fill_(-1))
    for t in tensors:
        queue.push(t)
    return queue
