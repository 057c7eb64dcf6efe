"""check_pt2_archive: the order in which a .pt2 is checked, and the errors of a damaged zip.

The layout is checked first (nothing is read but the zip directory), then the CRC, the format,
each model, that every payload is referenced, and last the registered package kinds' rules,
so the message names the first thing wrong in that order.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph.archive.layout import Pt2Archive
from asyncgraph.graph.archive.member_rules import registered_member_rules
from asyncgraph.graph.archive.models import check_model


def existing_file(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, or ProgramLoadError when it is a directory or does not exist."""
    p = Path(path)
    if p.is_dir():
        raise ProgramLoadError(f"{p}: is a directory, not a .pt2 file")
    if not p.is_file():
        raise ProgramLoadError(f"{p}: no such file")
    return p


def check_pt2_archive(
    path: str | os.PathLike[str], *, verify_crc: bool = True, trust_compiled: bool = False
) -> None:
    """Raise ProgramLoadError unless `path` is a .pt2 that torch.export.load may safely read.

    Nothing from the file is executed or unpickled. `verify_crc=False` skips reading every
    member to check its CRC (when the caller has run `ZipFile.testzip()` already).
    `trust_compiled=True` accepts the AOTInductor models of a compiled package (native code,
    which the caller then loads), checked by the rules compiled/ registers (member_rules.py).
    """
    p = existing_file(path)
    if not zipfile.is_zipfile(p):
        with p.open("rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04":
            raise ProgramLoadError(f"{p}: truncated or corrupt archive (no zip directory)")
        raise ProgramLoadError(f"{p}: not a .pt2 archive (not a zip file)")
    try:
        with zipfile.ZipFile(p) as archive:
            _check(Pt2Archive(p, archive, trust_compiled), verify_crc)
    except ProgramLoadError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise ProgramLoadError(f"{p}: truncated or corrupt archive ({exc})") from None
    except Exception as exc:  # zlib.error and friends: the archive is damaged
        raise ProgramLoadError(f"{p}: truncated or corrupt archive ({exc!r})") from None


def _check(archive: Pt2Archive, verify_crc: bool) -> None:
    if verify_crc:
        archive.check_crc()
    archive.check_format()
    referenced: set[str] = set()
    for model in archive.model_names():
        referenced |= check_model(archive, model)
    archive.check_referenced(referenced)
    for rules in registered_member_rules():
        rules.check_archive(archive)
