"""asyncgraph's folder of things worth keeping across processes: where it is, and how a file
in it is written so that no reader sees half of it.

Why one module: the exported segments (compiled/export_cache.py) and the fast forms'
verdicts (runtime/form_verdicts.py) are both kept so that a restart, or a second replica on
the same machine, starts where the first left off; they share the folder, the switch that
turns it off and the atomic write.

Root: `$ASYNCGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/asyncgraph`, else `~/.cache/asyncgraph`.
`ASYNCGRAPH_CACHE_DIR=` (empty) turns the cache off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

ENV = "ASYNCGRAPH_CACHE_DIR"


def cache_root() -> Path | None:
    """Where cached artefacts live; None when `ASYNCGRAPH_CACHE_DIR` is set empty (off)."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "asyncgraph"


def cpu_model() -> str:
    """The machine's CPU, as /proc/cpuinfo names it (what compiled code and timings depend on)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def digest(kind: str, environment: str, *parts: Any) -> str:
    """A SHA-256 key of an artefact of `kind`, made in `environment` from `parts` (their reprs)."""
    hashed = hashlib.sha256(f"{kind}\n{environment}".encode())
    for part in parts:
        hashed.update(b"\n")
        hashed.update(repr(part).encode())
    return hashed.hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place: a reader
    sees the old file or the new one, never half, and two writers both leave a whole one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    placed = False
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
        placed = True
    finally:
        if not placed:
            Path(tmp).unlink(missing_ok=True)
