"""Inputs and outputs of the CLI: tensors from .pt / .npy / .safetensors files, random inputs
that fit a signature, and outputs saved or printed.

Inputs are named after the program's placeholders (`x`, a keyword's name), the same names the
server uses. A file holding one tensor fills the next input in order, or the one named with
`NAME=PATH`; a file holding several (a .safetensors file, a .pt dict or list) fills inputs by
name or in order. Random inputs take the example shapes the program was exported with, which
satisfy every dimension constraint by construction.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from asyncgraph.errors import InputValidationError
from asyncgraph.graph.ir import Graph, ScalarSpec

if TYPE_CHECKING:
    from asyncgraph.runtime.executor import Executor

INPUT_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")


def input_names(graph: Graph) -> list[str]:
    """The flat user inputs' names, in signature order."""
    return [graph.values[s.value].name for s in graph.signature.user_inputs]


def chosen_inputs(
    ex: Executor, sources: Sequence[str] | None, use_random: bool, seed: int
) -> list[Any]:
    """The flat inputs a command runs on, the same for every command: the `--input` files,
    else the sample inputs saved in the program (unless `--random`), else random ones."""
    from asyncgraph.tools.profile import example_inputs

    if sources and use_random:
        raise InputValidationError("give input files (--input) or --random, not both")
    if sources:
        return load_inputs(ex.graph, sources)
    try:
        return example_inputs(ex, seed, use_random=use_random)
    except ValueError as exc:
        raise InputValidationError(f"{exc} (give its value with --input)") from None


def load_inputs(graph: Graph, sources: Sequence[str]) -> list[Any]:
    """Flat user inputs from files (see the module docstring); inputs fixed at export filled."""
    names = input_names(graph)
    users = graph.signature.user_inputs
    values: dict[str, Any] = {}
    order = iter(n for n in names)

    def next_free() -> str:
        for name in order:
            if name not in values:
                return name
        raise InputValidationError(
            f"too many inputs: the program takes {len(names)} ({', '.join(names)})"
        )

    for source in sources:
        name, _, path = source.rpartition("=") if "=" in source else ("", "", source)
        content = read_tensors(Path(path))
        if name:
            if name not in names:
                raise InputValidationError(
                    f"--input {source}: unknown input {name!r}; expected one of {', '.join(names)}"
                )
            values[name] = content
        elif isinstance(content, dict):
            unknown = [k for k in content if k not in names]
            if unknown:
                raise InputValidationError(
                    f"{path}: unknown input(s) {', '.join(map(repr, unknown))}; "
                    f"expected {', '.join(names)}"
                )
            values.update(content)
        elif isinstance(content, (list, tuple)):
            for item in content:
                values[next_free()] = item
        else:
            values[next_free()] = content
    flat: list[Any] = []
    missing: list[str] = []
    for name, spec_in in zip(names, users, strict=True):
        spec = graph.values[spec_in.value].spec
        if name in values:
            flat.append(values[name])
        elif isinstance(spec, ScalarSpec) and spec.fixed:
            flat.append(spec.value)
        else:
            missing.append(name)
    if missing:
        raise InputValidationError(
            f"missing input(s) {', '.join(missing)}; give them as files, or use --random"
        )
    return flat


def read_tensors(path: Path) -> Any:
    """A tensor, a list of tensors or a dict of tensors from a .pt/.npy/.safetensors file."""
    suffix = path.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        raise InputValidationError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; "
            f"expected one of {', '.join(INPUT_SUFFIXES)}"
        )
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a tensor file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if suffix == ".npy":
        import numpy as np

        array = np.load(path, allow_pickle=False)
        return torch.from_numpy(array.copy())
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InputValidationError(f"{path}: cannot load tensors ({exc})") from exc
    leaves = pytree.tree_leaves(content)
    if not all(isinstance(x, (torch.Tensor, int, float, bool)) for x in leaves):
        raise InputValidationError(f"{path}: expected tensors, a list or a dict of tensors")
    return content


def check_output_path(path: Path) -> None:
    """Raise when `path` cannot be written: a directory, or a folder that is missing or not
    writable. Commands call it before running, so a bad -o does not cost a whole run."""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{path}: directory {folder} is not writable")


def output_names(graph: Graph, count: int) -> list[str]:
    """The flat outputs' names, as the server reports them (output_0, a dict key, ...)."""
    from asyncgraph.serve.interface import output_names as names

    return names(graph.signature.out_spec, count)


def save_outputs(path: Path, names: Sequence[str], flat: Sequence[Any], structured: Any) -> None:
    """Save outputs: .safetensors by name, .pt as the returned structure, .npy a single one."""
    suffix = path.suffix.lower()
    if suffix == ".pt" or suffix == ".pth":
        torch.save(structured, path)
    elif suffix == ".safetensors":
        from safetensors.torch import save_file

        tensors = {}
        for name, value in zip(names, flat, strict=True):
            tensors[name] = (value if isinstance(value, torch.Tensor)
                             else torch.tensor(value)).detach().cpu().contiguous()
        save_file(tensors, str(path))
    elif suffix == ".npy":
        import numpy as np

        if len(flat) != 1:
            raise InputValidationError(
                f"{path}: a .npy file holds one array and the program returns {len(flat)} "
                "outputs; use .safetensors or .pt"
            )
        value = flat[0]
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        np.save(path, tensor.detach().cpu().numpy())
    else:
        raise InputValidationError(
            f"{path}: unsupported output file type {suffix or '(none)'!r}; "
            "expected .safetensors, .pt or .npy"
        )


def summarize(value: Any) -> tuple[str, str, str]:
    """(dtype, shape, a few statistics and values) of an output, for a table."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__, "", repr(value)
    t = value.detach().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    shape = "[" + ", ".join(map(str, t.shape)) + "]"
    if t.numel() == 0:
        return dtype, shape, "(empty)"
    flat = t.reshape(-1)
    head = ", ".join(_fmt(x) for x in flat[:4].tolist()) + (", ..." if t.numel() > 4 else "")
    if t.dtype.is_floating_point:
        f = flat.float()
        stats = f"min {f.min().item():.4g}  max {f.max().item():.4g}  mean {f.mean().item():.4g}"
        return dtype, shape, f"{stats}  [{head}]"
    return dtype, shape, f"[{head}]"


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)
