"""Packed weights: constants that inductor's C++ micro-GEMM derives from a weight at compile time.

With max-autotune (`compile_program(autotune=True)`) inductor may replace a matmul by its C++
micro-GEMM, which reads the weight in a blocked layout that it computes once, at compile time,
as a new constant (`constant6`, shape [blocks, K, block_n]); the weight's own constant is then
unused. A constant-buffer update of the weight alone would change nothing the kernel reads, and
the runtime folding that would recompute the blocked copy fails to compile with that GEMM
(torch 2.11-2.13: "Not all constant gets mapped for constant folding graph").

So asyncgraph recomputes the blocked copy itself at each swap, and loads it beside the weight.
Which weight each packed constant comes from is found on the compiled model, not assumed:
`find_packed` loads the package, and for each new constant tries the weights whose shapes fit,
keeping the one whose blocked copy leaves the model's outputs bit for bit unchanged; then
`verify_packed` swaps in other weights and compares the model against the segment run eagerly.
A segment whose packed constants cannot all be traced this way keeps them frozen: its weights
refuse swaps, with the reason in the manifest.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_INFO = re.compile(r"constants_info_\[(\d+)\]\.(name|shape) = ([^;]*);")


@dataclass(frozen=True)
class PackedConstant:
    """Constant `name` of an AOTI model = `pack(source weight, transposed, shape)`."""

    name: str
    source: str  # the model's constant it is derived from (a weight of the segment)
    transposed: bool  # packs the weight's transpose: a linear's [N, K] weight, read as [K, N]
    shape: tuple[int, int, int]  # [blocks, K, block_n]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return pack(weight, self.transposed, self.shape)


def pack(weight: torch.Tensor, transposed: bool, shape: Sequence[int]) -> torch.Tensor:
    """The micro-GEMM's layout of a [K, N] matrix (the weight or its transpose): N padded with
    zeros to blocks * block_n, cut into blocks of block_n columns, each block [K, block_n]
    contiguous (inductor's CppGemmTemplate.prep_weight for float weights)."""
    if not _fits(weight, transposed, shape):
        raise ValueError(f"a {list(weight.shape)} weight does not pack to {list(shape)}")
    blocks, k, block_n = shape
    matrix = weight.detach().t() if transposed else weight.detach()
    matrix = torch.nn.functional.pad(matrix, (0, blocks * block_n - matrix.shape[1]))
    return matrix.reshape(k, blocks, block_n).permute(1, 0, 2).contiguous()


def constant_shapes(package: str | Path) -> dict[str, tuple[int, ...]]:
    """Each constant's shape as the package's generated wrapper declares it."""
    shapes: dict[str, tuple[int, ...]] = {}
    with zipfile.ZipFile(package) as archive:
        for member in archive.namelist():
            if not member.endswith(".cpp"):
                continue
            fields: dict[str, dict[str, str]] = {}
            for index, key, value in _INFO.findall(archive.read(member).decode(errors="replace")):
                fields.setdefault(index, {})[key] = value
            for entry in fields.values():
                if "name" in entry and "shape" in entry:
                    dims = entry["shape"].strip("{} ")
                    shapes[entry["name"].strip('"')] = tuple(
                        int(d) for d in dims.split(",") if d.strip())
    return shapes


class PackingError(Exception):
    """A packed constant that cannot be traced to a weight, or a swap through it that is wrong."""


Reference = Callable[[Mapping[str, torch.Tensor]], Sequence[Any]]


def find_packed(
    loader: Any, package: str | Path, weights: Mapping[str, torch.Tensor], args: Sequence[Any],
    reference: Reference,
) -> list[PackedConstant]:
    """The packed constants of a loaded AOTI model (`loader`: torch's AOTIModelPackageLoader)
    whose weights are `weights` (constant name -> tensor), each traced to its weight on `args`;
    `reference` runs the segment eagerly on given weights. Raises PackingError naming the
    first that cannot be traced."""
    extra = sorted(set(loader.get_constant_fqns()) - set(weights))
    if not extra:
        return []
    shapes = constant_shapes(package)
    baseline = loader.run(list(args))
    found = []
    for name in extra:
        shape = shapes.get(name, ())
        if len(shape) != 3:
            raise PackingError(f"constant {name} (shape {list(shape)}) is not a packed matrix")
        matches = [
            PackedConstant(name, source, transposed, (shape[0], shape[1], shape[2]))
            for source, weight in weights.items() for transposed in (True, False)
            if _fits(weight, transposed, shape)
            and _unchanged(loader, {name: pack(weight, transposed, shape)}, args, baseline)
        ]
        if not matches:
            raise PackingError(f"constant {name} {list(shape)}: no weight packs to it")
        if len(matches) > 1:  # weights of equal values (layers cloned from one layer)
            read = [m for m in matches if _reads(loader, m, weights, args, reference)]
            if len(read) != 1:
                raise PackingError(
                    f"constant {name} {list(shape)}: weights {sorted(m.source for m in matches)}"
                    " pack to it and moving each alone does not tell which it reads")
            matches = read
        found.append(matches[0])  # its packing is the compiled value: load it back
        loader.load_constants({name: matches[0].pack(weights[matches[0].source])}, False, False)
    return found


def verify_packed(
    loader: Any, packed: Sequence[PackedConstant], weights: Mapping[str, torch.Tensor],
    args: Sequence[Any], reference: Reference,
) -> None:
    """Swap other weights in (float weights moved by noise of their own scale), with their
    packed copies, and check the model against `reference` (the segment run eagerly on those
    weights); then load the original weights back. Raises PackingError on a difference."""
    generator = torch.Generator().manual_seed(0)
    moved = {name: _moved(w, generator) for name, w in weights.items()}
    try:
        _load(loader, moved, packed)
        mismatch = _mismatch(loader.run(list(args)), reference(moved))
        if mismatch:
            raise PackingError(f"after a swap through the packed constants {mismatch}")
    finally:
        _load(loader, weights, packed)


def _reads(loader: Any, candidate: PackedConstant, weights: Mapping[str, torch.Tensor],
           args: Sequence[Any], reference: Reference) -> bool:
    """Whether the kernel reading `candidate.name` computes with `candidate.source`, told apart
    from weights of equal values: with that weight alone moved, and packed into this constant,
    the model must agree with the segment run eagerly on the moved weights."""
    source = candidate.source
    moved = {**weights, source: _moved(weights[source], torch.Generator().manual_seed(1))}
    try:
        _load(loader, {source: moved[source]}, [candidate], moved)
        return not _mismatch(loader.run(list(args)), reference(moved))
    finally:
        _load(loader, {source: weights[source]}, [candidate], weights)


def _load(loader: Any, weights: Mapping[str, torch.Tensor],
          packed: Sequence[PackedConstant], sources: Mapping[str, torch.Tensor] | None = None,
          ) -> None:
    """Load `weights` and the packed constants, packed from `sources` (default: `weights`)."""
    sources = weights if sources is None else sources
    tensors = {name: w.detach().contiguous() for name, w in weights.items()}
    tensors.update({p.name: p.pack(sources[p.source]) for p in packed})
    loader.load_constants(tensors, False, False)


def _mismatch(got: Sequence[Any], want: Sequence[Any]) -> str:
    """How the model's outputs differ from the eager segment's ("" when they agree)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor) and b.is_floating_point() and not torch.allclose(
                a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(b.abs().max()))):
            return f"output {i} is {float((a - b).abs().max()):.3g} off the eager segment's"
    return ""


def _fits(weight: torch.Tensor, transposed: bool, shape: Sequence[int]) -> bool:
    if weight.dim() != 2 or not weight.is_floating_point():
        return False
    k, n = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
    blocks, rows, block_n = shape
    return rows == k and (blocks - 1) * block_n < n <= blocks * block_n


def _unchanged(loader: Any, update: Mapping[str, torch.Tensor], args: Sequence[Any],
               baseline: Sequence[Any]) -> bool:
    loader.load_constants(dict(update), False, False)
    outputs = loader.run(list(args))
    return all(torch.equal(a, b) for a, b in zip(outputs, baseline, strict=True))


def _moved(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if not weight.is_floating_point():
        return weight
    scale = float(weight.detach().abs().mean()) or 1.0
    noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * scale
    return (weight.detach() + noise).contiguous()
