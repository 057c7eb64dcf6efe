"""The zip layout of a .pt2: where members may be, what they may be called, which must exist.

torch.export.save writes one root directory holding archive_format, archive_version, models/,
data/weights|constants|sample_inputs/ and extra/. Anything else is a format asyncgraph does not
load (compiled code, TorchScript, ExecuTorch, legacy pickled programs) or a path that could
escape the root; both are refused before any member is read. Members under a directory a
registered package kind owns (member_rules.py) are accepted only from a trusting caller, and
only as those rules allow.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph.archive.compiled_marker import TRUST_HINT
from asyncgraph.graph.archive.member_rules import registered_member_rules

_ROOT_FILES = {"archive_format", "archive_version", "byteorder"}
_AOTI_DIR = "data/aotinductor/"
_REFUSED_DIRS = {
    _AOTI_DIR: "AOTInductor compiled code (a shared library)",
    "data/executorch/": "an ExecuTorch program",
    "data/mtia": "MTIA compiled code",
    "xl_model_weights/": "externally loaded weights",
}
_REQUIRED = ("archive_format", "archive_version")
PAYLOAD_DIRS = ("data/weights/", "data/constants/")


class Pt2Archive:
    """One opened .pt2: its file members by path under the root, each already classified.

    `fail` builds the error with the file name in front; `trust_compiled` lets the members of
    registered package kinds in (member_rules.py).
    """

    def __init__(self, path: Path, archive: zipfile.ZipFile, trust_compiled: bool) -> None:
        self.path = path
        self.archive = archive
        self.trust_compiled = trust_compiled
        self.root = ""
        self.members: dict[str, zipfile.ZipInfo] = {}
        self._read_members()

    def fail(self, message: str) -> ProgramLoadError:
        return ProgramLoadError(f"{self.path}: {message}")

    def read(self, rel: str) -> bytes:
        return self.archive.read(self.root + rel)

    def read_json(self, rel: str) -> Any:
        if rel not in self.members:
            raise self.fail(f"missing member {rel!r}")
        try:
            return json.loads(self.read(rel))
        except (ValueError, RecursionError) as exc:
            raise self.fail(f"{rel}: invalid JSON ({str(exc)[:200]})") from None

    # -- members -----------------------------------------------------------------------------

    def _read_members(self) -> None:
        """One root, no duplicate or escaping paths, no legacy format, every member known."""
        infos = self.archive.infolist()
        if not infos:
            raise self.fail("empty archive")
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise self.fail("archive has duplicate member names")
        if "version" in names or "serialized_exported_program.json" in names:
            raise self.fail(
                "legacy .pt2 format (before torch 2.7), which is loaded through pickle; "
                "re-export the program with torch.export.save"
            )
        root = names[0].split("/", 1)[0] + "/"
        for info in infos:
            name = info.filename
            if not name.startswith(root) or name == root:
                raise self.fail(f"member {name!r} is outside the archive root {root!r}")
            rel = name[len(root):]
            if info.is_dir():
                continue
            if rel.startswith("/") or "\\" in rel or ".." in rel.split("/") or "\0" in rel:
                raise self.fail(f"member {name!r} has an unsafe path")
            self.members[rel] = info
        self.root = root
        for rel in self.members:
            self._classify(rel)

    def _classify(self, rel: str) -> None:
        if self.trust_compiled:
            for rules in registered_member_rules():
                if rel.startswith(rules.prefix):
                    rules.check_member(self, rel)
                    return
        if rel.startswith(_AOTI_DIR):
            raise self.fail(
                f"member {rel!r} is AOTInductor compiled code (a shared library), native code "
                f"that runs when loaded; {TRUST_HINT}"
            )
        for prefix, what in _REFUSED_DIRS.items():
            if rel.startswith(prefix):
                raise self.fail(f"member {rel!r} is {what}, which asyncgraph does not load")
        if rel in _ROOT_FILES or rel.startswith((".data/", "extra/")):
            return
        if rel.startswith("models/") and rel.endswith(".json") and rel.count("/") == 1:
            return
        if rel.startswith("data/sample_inputs/") and rel.endswith(".pt") and rel.count("/") == 2:
            return
        if rel.startswith(PAYLOAD_DIRS) and rel.count("/") == 2:
            base = rel.rsplit("/", 1)[1]
            if base.endswith(".pt"):
                raise self.fail(
                    f"member {rel!r} is a legacy pickled state dict, which torch loads "
                    "without weights_only; re-export the program with torch.export.save"
                )
            return
        raise self.fail(f"unexpected member {rel!r} in a .pt2 archive")

    # -- whole-archive checks ----------------------------------------------------------------

    def check_crc(self) -> None:
        """Read every member: a CRC mismatch is a damaged (or tampered) file."""
        bad = self.archive.testzip()
        if bad is not None:
            raise self.fail(f"archive member {bad!r} is corrupt (CRC mismatch)")

    def check_format(self) -> None:
        """The members that make a zip a .pt2 of the one version torch reads."""
        for required in _REQUIRED:
            if required not in self.members:
                raise self.fail(f"missing member {required!r}: not a .pt2 archive")
        if self.read("archive_format").decode(errors="replace").strip() != "pt2":
            raise self.fail("archive_format is not 'pt2'")
        version = self.read("archive_version").decode(errors="replace").strip()
        if version != "0":
            raise self.fail(f"archive version {version[:20]!r} is not supported (expected '0')")

    def model_names(self) -> list[str]:
        """The models (models/<name>.json), sorted; the program itself is `model`."""
        models = sorted(
            n[len("models/"):-len(".json")] for n in self.members
            if n.startswith("models/") and n.endswith(".json")
        )
        if "model" not in models:
            raise self.fail("no models/model.json: not a program written by torch.export.save")
        return models

    def check_referenced(self, referenced: set[str]) -> None:
        """Every payload is named by some weights or constants config (no smuggled files)."""
        for name in self.members:
            if name.startswith(PAYLOAD_DIRS) and name not in referenced:
                raise self.fail(f"member {name!r} is not referenced by any weights config")
