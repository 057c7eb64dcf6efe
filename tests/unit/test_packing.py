"""Packed weights (compiled/packing.py) on a stand-in for an AOTI model: the layout, tracing a
packed constant to its weight, refusing what cannot be traced, and the check by a swap. The
real compiled model: tests/integration/test_compiled.py (autotuned segments)."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgraph.compiled.packing import (
    PackedConstant,
    PackingError,
    constant_shapes,
    find_packed,
    pack,
    verify_packed,
)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    blocks, k, block_n = packed.shape
    return packed.permute(1, 0, 2).reshape(k, blocks * block_n)[:, :n]


class PackedLinear:
    """An AOTI model stand-in: y = x @ W + b where W [K, N] is read from the packed constant
    `constant9` (as the C++ GEMM reads it), never from the weight constants themselves."""

    def __init__(self, weights: Mapping[str, torch.Tensor], shape: tuple[int, int, int],
                 source: str = "w1") -> None:
        self.constants = {k: v.clone() for k, v in weights.items()}
        self.constants["constant9"] = pack(weights[source], True, shape)
        self.n = weights[source].shape[0]
        self.loads = 0

    def get_constant_fqns(self) -> list[str]:
        return list(self.constants)

    def run(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [args[0] @ unpack(self.constants["constant9"], self.n) + self.constants["b"]]

    def load_constants(self, tensors: Mapping[str, torch.Tensor], use_inactive: bool,
                       check_full_update: bool) -> None:
        self.loads += 1
        self.constants.update({k: v.clone() for k, v in tensors.items()})


def package_with(path: Path, shapes: dict[str, str]) -> Path:
    """An archive whose wrapper declares constants as inductor's generated code does."""
    lines = []
    for i, (name, shape) in enumerate(shapes.items()):
        lines += [f'    constants_info_[{i}].name = "{name}";',
                  f"    constants_info_[{i}].shape = {shape};"]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m/data/aotinductor/model/abc.wrapper.cpp", "\n".join(lines))
        archive.writestr("m/data/aotinductor/model/abc.wrapper.so", b"\0")
    return path


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(20, 12, generator=g), "w2": torch.randn(12, 20, generator=g),
            "b": torch.randn(20, generator=g), "steps": torch.tensor([3])}


def test_pack_is_the_blocked_layout_with_zero_padding() -> None:
    w = torch.arange(20 * 12, dtype=torch.float32).reshape(20, 12)  # a linear's [N, K]
    packed = pack(w, True, (3, 12, 8))  # N = 20 padded to 24
    assert packed.shape == (3, 12, 8) and packed.is_contiguous()
    torch.testing.assert_close(packed[1], w.t()[:, 8:16], rtol=0, atol=0)
    torch.testing.assert_close(packed[2, :, :4], w.t()[:, 16:], rtol=0, atol=0)
    assert not packed[2, :, 4:].any()
    torch.testing.assert_close(unpack(pack(w.t(), False, (3, 12, 8)), 20), w.t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"a \[20, 12\] weight does not pack to \[2, 12, 8\]"):
        pack(w, True, (2, 12, 8))


def test_constant_shapes_are_read_from_the_generated_wrapper(tmp_path: Path) -> None:
    path = package_with(tmp_path / "m.pt2", {"w1": "{20, 12}", "constant9": "{3, 12, 8}",
                                             "scalar": "{}"})
    assert constant_shapes(path) == {"w1": (20, 12), "constant9": (3, 12, 8), "scalar": ()}


def reference(x: torch.Tensor, source: str = "w1") -> Any:
    """The stand-in's segment run eagerly on given weights."""
    return lambda moved: [x @ moved[source].t() + moved["b"]]


def test_a_packed_constant_is_traced_to_its_weight(tmp_path: Path) -> None:
    """w2.t() has w1's [K, N] shape too, so both are tried; only w1's packing leaves the
    outputs unchanged. The model keeps the compiled values afterwards."""
    w = weights()
    model = PackedLinear(w, (3, 12, 8))
    compiled = model.constants["constant9"].clone()
    path = package_with(tmp_path / "m.pt2", {"constant9": "{3, 12, 8}"})
    x = torch.randn(4, 12)
    found = find_packed(model, path, w, [x], reference(x))
    assert found == [PackedConstant("constant9", "w1", True, (3, 12, 8))]
    torch.testing.assert_close(model.constants["constant9"], compiled, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["w1", "w3"])
def test_weights_of_equal_values_are_told_apart_by_moving_each(
        tmp_path: Path, source: str) -> None:
    """Layers cloned from one layer (nn.TransformerEncoder's) have weights of equal values:
    both pack to the constant. Moved alone, only the one the kernel reads agrees with the
    eager segment; the model keeps its compiled values afterwards."""
    w = weights()
    twin = {**w, "w3": w["w1"].clone()}
    model = PackedLinear(twin, (3, 12, 8), source)
    before = {k: v.clone() for k, v in model.constants.items()}
    path = package_with(tmp_path / "m.pt2", {"constant9": "{3, 12, 8}"})
    x = torch.randn(4, 12)
    found = find_packed(model, path, twin, [x], reference(x, source))
    assert found == [PackedConstant("constant9", source, True, (3, 12, 8))]
    for name, value in before.items():
        torch.testing.assert_close(model.constants[name], value, rtol=0, atol=0)
    with pytest.raises(PackingError, match=r"constant9 \[3, 12, 8\]: weights \['w1', 'w3'\] "
                       r"pack to it and moving each alone does not tell which it reads"):
        find_packed(model, path, twin, [x], lambda moved: [torch.zeros(4, 20)])


def test_a_constant_no_weight_packs_to_is_refused(tmp_path: Path) -> None:
    w = weights()
    x = torch.randn(4, 12)
    model = PackedLinear(w, (3, 12, 8))
    model.constants["constant9"] += 1  # made from something that is not a weight
    path = package_with(tmp_path / "m.pt2", {"constant9": "{3, 12, 8}"})
    with pytest.raises(PackingError, match=r"constant9 \[3, 12, 8\]: no weight packs to it"):
        find_packed(model, path, w, [x], reference(x))
    flat = package_with(tmp_path / "flat.pt2", {"constant9": "{240}"})
    with pytest.raises(PackingError, match=r"constant9 \(shape \[240\]\) is not a packed matrix"):
        find_packed(PackedLinear(w, (3, 12, 8)), flat, w, [x], reference(x))


def test_no_new_constants_nothing_to_trace(tmp_path: Path) -> None:
    w = weights()
    model = PackedLinear(w, (3, 12, 8))
    x = torch.randn(1, 12)
    assert find_packed(model, tmp_path / "unread.pt2", {**w, "constant9": torch.ones(1)},
                       [x], reference(x)) == []


def test_verify_swaps_other_weights_in_then_loads_the_originals_back() -> None:
    w = weights()
    model = PackedLinear(w, (3, 12, 8))
    x = torch.randn(4, 12)
    before = model.run([x])[0]
    packed = [PackedConstant("constant9", "w1", True, (3, 12, 8))]
    verify_packed(model, packed, w, [x], reference(x))
    assert model.loads == 2
    torch.testing.assert_close(model.run([x])[0], before, rtol=0, atol=0)


def test_verify_catches_a_wrong_packing() -> None:
    """Traced to the wrong weight, a swap computes with stale values: the check says how far."""
    w = weights()
    model = PackedLinear(w, (3, 12, 8))
    x = torch.randn(4, 12)
    wrong = [PackedConstant("constant9", "w2", False, (3, 12, 8))]
    with pytest.raises(PackingError, match=r"output 0 is .* off the eager segment's"):
        verify_packed(model, wrong, w, [x], reference(x))
    torch.testing.assert_close(model.constants["w1"], w["w1"], rtol=0, atol=0)  # loaded back
