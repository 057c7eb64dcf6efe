"""The names users give dynamic dimensions (`Dim("batch")`), kept across a save and a load.

torch.export keeps a Dim's name only in the shape environment of the exported program in
memory; a .pt2 records the symbol torch made for it (`s45`) and its range, not the name. So
errors about an in-memory program say `(Dim 'batch')` and about the same program loaded from a
file said `(dynamic dim s45)`. `asyncgraph.save` (loading.py) writes the names beside the
program, as a small JSON member under the archive's `extra/` (torch.export.load ignores it),
and `read` finds them when the archive is loaded. A .pt2 saved by torch.export.save has none:
errors then name the dimension by the input it sizes (`dynamic dim of x.shape[0]`).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

MEMBER = "asyncgraph_dim_names.json"  # torch writes it as <root>/extra/<MEMBER>
_MAX_BYTES = 1 << 16  # the names of a program's dims: far below this; more is not ours


def member(names: dict[tuple[int, int], str]) -> str:
    """The JSON `save` writes beside a program: (input, dim) -> name as a list of triples."""
    return json.dumps({"dim_names": [[i, dim, name] for (i, dim), name in sorted(names.items())]})


def read(path: Path) -> dict[tuple[int, int], str]:
    """(input, dim) -> name, as `member` wrote them, or {} when the archive has none or they do
    not read as such (a name is only ever used in messages: nothing else trusts it)."""
    try:
        with zipfile.ZipFile(path) as archive:
            member = next((i for i in archive.infolist()
                           if i.filename.endswith(f"/extra/{MEMBER}")), None)
            if member is None or member.file_size > _MAX_BYTES:
                return {}
            entries = json.loads(archive.read(member)).get("dim_names", [])
    except (OSError, ValueError, AttributeError, zipfile.BadZipFile):
        return {}
    names: dict[tuple[int, int], str] = {}
    for entry in entries if isinstance(entries, list) else []:
        if (isinstance(entry, list) and len(entry) == 3
                and all(isinstance(v, int) and v >= 0 for v in entry[:2])
                and isinstance(entry[2], str) and entry[2].isidentifier()):
            names[(entry[0], entry[1])] = entry[2]
    return names
