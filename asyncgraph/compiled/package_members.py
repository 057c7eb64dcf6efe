"""The members a compiled package adds to a .pt2, as the archive check accepts them.

A package of `asyncgraph compile` (package.py) is a .pt2 in torch's package_pt2 layout plus
AOTInductor models, `data/aotinductor/aoti_segment_<i>/` each holding one wrapper .so, C++
sources and JSON metadata, and a manifest `extra/asyncgraph_compiled.json` that lists those
segments. graph/archive/ checks torch's layout and refuses native code unless the caller
trusts it, but must not know this shape (graph/ is below compiled/): this module registers it
there (graph/archive/member_rules.py) when it is imported. compiled/package.py (which
load_compiled, and so compile_program's load-back, lives in) and asyncgraph/loading.py import
it, so the rules are in place before either checks an archive, whichever public module the
caller imported first (`import asyncgraph` alone imports neither: its names are lazy).
"""

from __future__ import annotations

import re
from typing import Any

from asyncgraph.graph.archive.compiled_marker import COMPILED_MANIFEST
from asyncgraph.graph.archive.member_rules import ArchiveMembers, register_member_rules

_AOTI_DIR = "data/aotinductor/"
_AOTI_MEMBER = re.compile(r"data/aotinductor/(aoti_segment_\d+)/([A-Za-z0-9_.-]+)\Z")
_AOTI_SUFFIXES = (".wrapper.so", ".so", ".cpp", ".json")
_SEGMENT_FIELDS = ("name", "nodes", "inputs", "outputs", "contiguous")


class CompiledPackageMembers:
    """The AOTInductor members of a compiled package and their agreement with its manifest."""

    prefix = _AOTI_DIR

    def check_member(self, archive: ArchiveMembers, rel: str) -> None:
        """Only a segment's .so, .cpp and .json files: nothing else runs or is read."""
        if not _AOTI_MEMBER.match(rel) or not rel.endswith(_AOTI_SUFFIXES):
            raise archive.fail(
                f"unexpected member {rel!r} in a compiled package (expected "
                "data/aotinductor/aoti_segment_<i>/ with .so, .cpp and .json files)"
            )

    def check_archive(self, archive: ArchiveMembers) -> None:
        """The AOTI members are exactly the manifest's segments, one shared library each."""
        libraries: dict[str, list[str]] = {}
        for rel in archive.members:
            match = _AOTI_MEMBER.match(rel)
            if match:
                libraries.setdefault(match.group(1), [])
                if rel.endswith(".so"):
                    libraries[match.group(1)].append(rel)
        manifest_member = "extra/" + COMPILED_MANIFEST
        if not libraries and manifest_member not in archive.members:
            return
        if manifest_member not in archive.members:
            raise archive.fail(f"compiled code without a manifest ({manifest_member} is missing)")
        manifest = archive.read_json(manifest_member)
        segments = manifest.get("segments") if isinstance(manifest, dict) else None
        if not isinstance(segments, list) or not isinstance(manifest.get("platform"), dict):
            raise archive.fail(f"{manifest_member}: expected 'segments' and 'platform'")
        names = [_manifest_segment(archive, manifest_member, s) for s in segments]
        if sorted(names) != sorted(libraries) or len(set(names)) != len(names):
            raise archive.fail(
                f"{manifest_member}: lists segments {sorted(names)}, but the archive holds "
                f"compiled models {sorted(libraries)}"
            )
        for name, sos in libraries.items():
            if len(sos) != 1:
                raise archive.fail(
                    f"compiled model {name} has {len(sos)} shared libraries, not 1"
                )


def _manifest_segment(archive: ArchiveMembers, where: str, entry: Any) -> str:
    """The name of one manifest segment, after checking the fields the loader reads."""
    if not isinstance(entry, dict) or any(f not in entry for f in _SEGMENT_FIELDS):
        raise archive.fail(
            f"{where}: a segment needs {', '.join(_SEGMENT_FIELDS)}: {entry!r:.200}"
        )
    name = entry["name"]
    if not isinstance(name, str) or not re.fullmatch(r"aoti_segment_\d+", name):
        raise archive.fail(f"{where}: invalid segment name {name!r:.100}")
    for key in ("nodes", "inputs", "outputs"):
        items = entry[key]
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise archive.fail(f"{where}: {name}.{key} must be a list of names")
    if not entry["nodes"]:
        raise archive.fail(f"{where}: {name} has no nodes")
    return name


COMPILED_PACKAGE_MEMBERS = CompiledPackageMembers()
register_member_rules(COMPILED_PACKAGE_MEMBERS)
