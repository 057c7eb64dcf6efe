"""The hook through which a package kind built on the .pt2 layout adds its own members.

torch's layout (layout.py) has no place for asyncgraph's compiled packages, whose AOTInductor
models are native code. graph/ refuses them unless the caller trusts them, and then must check
them against the shape their writer gives them, which only the upper layer (compiled/) knows.
So that layer registers a MemberRules here when it is imported (asyncgraph/loading.py imports
it, and `import asyncgraph` imports loading, so the rules are in place before any archive is
checked), and check_pt2_archive consults every registered one.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from typing import Any, Protocol

from asyncgraph.errors import ProgramLoadError


class ArchiveMembers(Protocol):
    """What a rule may read of the archive being checked (layout.Pt2Archive)."""

    @property
    def members(self) -> Mapping[str, zipfile.ZipInfo]:
        """Every file member, by its path under the archive root."""
        ...

    def read_json(self, rel: str) -> Any:
        """The member `rel` parsed as JSON; ProgramLoadError when it is missing or invalid."""
        ...

    def fail(self, message: str) -> ProgramLoadError:
        """The error to raise, with the archive's file name in front of `message`."""
        ...


class MemberRules(Protocol):
    """The members a package kind adds under `prefix`, and how they must agree."""

    @property
    def prefix(self) -> str:
        """The directory under the archive root whose members these rules own."""
        ...

    def check_member(self, archive: ArchiveMembers, rel: str) -> None:
        """Raise `archive.fail(...)` unless `rel`, under `prefix` in an archive the caller
        trusts, is a member this package kind writes. Untrusted, layout.py refuses it."""
        ...

    def check_archive(self, archive: ArchiveMembers) -> None:
        """Raise `archive.fail(...)` unless the package's members agree with each other (a
        manifest and the files it lists). Runs last on every archive, trusted or not."""
        ...


_REGISTERED: list[MemberRules] = []


def register_member_rules(rules: MemberRules) -> None:
    """Apply `rules` in every later check_pt2_archive; registering the same object twice
    changes nothing."""
    if all(r is not rules for r in _REGISTERED):
        _REGISTERED.append(rules)


def registered_member_rules() -> tuple[MemberRules, ...]:
    """The rules registered so far, in registration order."""
    return tuple(_REGISTERED)
