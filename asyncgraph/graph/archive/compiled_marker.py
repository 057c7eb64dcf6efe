"""How a compiled package is recognized, by any layer, without knowing what it holds.

A package of `asyncgraph compile` carries a manifest at `extra/asyncgraph_compiled.json`.
graph/ must tell such a file apart from a plain program, to refuse it with a hint instead of a
confusing member error (graph/importers.py), and layout.py refuses AOTInductor members with the
same hint. What the package's members must look like is compiled/'s business
(compiled/package_members.py), registered through member_rules.py.
"""

from __future__ import annotations

import os
import zipfile

COMPILED_MANIFEST = "asyncgraph_compiled.json"
TRUST_HINT = (
    "load it with asyncgraph.load(path, trust_compiled=True) (--trust-compiled on the command "
    "line) if you trust where it comes from"
)


def is_compiled_package(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a zip holding asyncgraph's compiled-package manifest (nothing is
    checked or loaded; a damaged file is simply not one)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(
                n.endswith("/extra/" + COMPILED_MANIFEST) and n.count("/") == 2
                for n in archive.namelist()
            )
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return False
