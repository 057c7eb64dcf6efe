"""What differs between the torch versions pyproject admits, pinned down where we can see it here.

torch 2.10-2.11's torch.export.load builds weights with torch.frombuffer over the archive's
read-only bytes and warns "The given buffer is not writable"; under `-W error` (as in this
suite, and in services that run that way) loading a .pt2 then failed. The test replays that
warning on the installed torch.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncgraph
from asyncgraph.graph.importers import load_pt2


def _save_linear(path: Path) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2).eval()
    torch.export.save(torch.export.export(model, (torch.randn(1, 3),)), path)
    return model


async def test_pt2_loads_when_torch_warns_its_buffer_is_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leak_check: object
) -> None:
    model = _save_linear(tmp_path / "m.pt2")
    real_load = torch.export.load

    def load_like_torch_2_11(path: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            "The given buffer is not writable, and PyTorch does not support non-writable "
            "tensors.", UserWarning, stacklevel=2,
        )
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch.export, "load", load_like_torch_2_11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex = asyncgraph.load(tmp_path / "m.pt2")
    async with ex:
        x = torch.randn(1, 3)
        torch.testing.assert_close(await ex.execute(x), model(x))


def test_other_warnings_from_loading_still_reach_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_linear(tmp_path / "m.pt2")
    real_load = torch.export.load

    def load_with_another_warning(path: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn("something else", UserWarning, stacklevel=2)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch.export, "load", load_with_another_warning)
    with pytest.warns(UserWarning, match="something else"):
        load_pt2(tmp_path / "m.pt2")
