"""Loading a .pt2 file: a plain exported program, or a compiled package.

graph/ reads plain programs only (graph/importers.py); a package made by `asyncgraph compile`
holds AOTInductor segments, native code that runs when loaded, which compiled/package.py reads
once the caller trusts it. This module picks between them, above both layers, so neither
imports the other. `asyncgraph.load` is `load` here, and `asyncgraph.save` is `save`.

It also imports compiled/package_members.py, which registers the compiled package's members
with graph/archive/: `import asyncgraph` imports this module, so every archive check, from any
entry point, applies those rules.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from asyncgraph.compiled import package_members  # noqa: F401 - registers its rules
from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph import dim_names
from asyncgraph.graph.archive import TRUST_HINT, is_compiled_package
from asyncgraph.graph.importers import Program, from_exported_program, open_pt2, read_plain_pt2
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.executor import Executor

if TYPE_CHECKING:
    from torch.export import ExportedProgram


def load_program(
    path: str | os.PathLike[str],
    *,
    trust_compiled: bool = False,
    runners: int = 1,
    threads: int | None = None,
) -> Program:
    """The Program of a .pt2 written by torch.export.save or by `asyncgraph compile`.

    A compiled package loads native code, so it is refused unless `trust_compiled`; `runners`
    is then how many executions each compiled segment runs at once, `threads` the intra-op
    count of the threads that run them, when known (compiled/package.py).
    """
    p = open_pt2(path)
    if is_compiled_package(p):
        if not trust_compiled:
            raise ProgramLoadError(
                f"{p}: an AOTInductor-compiled package (asyncgraph compile), which holds "
                f"native code that runs when loaded; {TRUST_HINT}"
            )
        from asyncgraph.compiled.package import load_compiled  # torch's AOTI on demand

        compiled: Program = load_compiled(p, runners=runners, threads=threads)
        return compiled
    return read_plain_pt2(p)


def save(ep: ExportedProgram, path: str | os.PathLike[str]) -> None:
    """`torch.export.save(ep, path)`, with the names of its dynamic dims (`Dim("batch")`) kept
    for the errors of a later `load` (graph/dim_names.py): torch's archive keeps only its own
    symbols for them."""
    import torch

    names = from_exported_program(ep).graph.signature.dim_names
    torch.export.save(ep, path, extra_files={dim_names.MEMBER: dim_names.member(names)})


def load(
    path: str | os.PathLike[str],
    config: ExecutorConfig | None = None,
    *,
    trust_compiled: bool = False,
) -> Executor:
    """Load a .pt2 file written by torch.export.save into an Executor.

    A package made by `asyncgraph compile` (AOTInductor segments) runs native code when loaded
    and needs `trust_compiled=True`; each compiled segment then gets one runner per worker
    thread, so parallel executions do not queue on it.
    """
    config = config if config is not None else ExecutorConfig()
    program = load_program(path, trust_compiled=trust_compiled, runners=config.max_parallel_ops,
                           threads=config.intra_op_threads_or_default)
    return Executor(program, config)
