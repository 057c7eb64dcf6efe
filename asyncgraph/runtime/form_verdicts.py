"""The fast forms' verdicts kept on disk, so that a restart, or a second replica on the same
machine, serves the faster form from its first request instead of measuring again.

Why: a verdict (runtime/forms.py) takes a few hundred executions to reach, served meanwhile
by the plain graph, and it depends only on the program and the machine, not on the weights
or the moment. A service restarts, scales out and reloads; each start would otherwise begin
slow. With the verdicts kept (and the exports the forms need, compiled/export_cache.py), a
start that finds a form chosen builds it at once, and its first requests wait for that build
(a tenth of a second) instead of running the plain graph.

What: one JSON file per program, `<root>/forms/<key>.json` (runtime/disk_cache.py's root),
mapping "<regime> <signature>" to the form chosen and why. The key hashes the program's
graph text, the forms tried (backends and thread counts), and what timings depend on: the
versions of Python, asyncgraph, torch and ONNX Runtime, the CPU model and the CPUs this
process may use. A file that cannot be read is no verdicts (logged); a write that fails only
logs.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
from collections.abc import Sequence
from typing import Any

from asyncgraph.runtime.disk_cache import cache_root, cpu_model, digest, write_atomically

LOG = logging.getLogger("asyncgraph.forms")
KIND = "forms"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which bound parallel work."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _environment() -> str:
    parts = [f"python={platform.python_version()}", f"cpu={cpu_model()}",
             f"cpus={usable_cpus()}"]
    for package in ("asyncgraph", "torch", "onnxruntime"):
        try:
            parts.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package}=none")
    return ";".join(parts)


class FormVerdicts:
    """One program's verdicts on disk (`load` at start, `store` as each is reached)."""

    def __init__(self, graph_text: str, backends: Sequence[str],
                 thread_counts: Sequence[int]) -> None:
        root = cache_root()
        key = digest(KIND, _environment(), graph_text, tuple(backends), tuple(thread_counts))
        self.path = root / KIND / f"{key}.json" if root is not None else None
        self.loaded = 0
        self.stored = 0

    def load(self) -> dict[str, tuple[str, str]]:
        """The verdicts kept: entry -> (form, why); none when the file is absent or unreadable."""
        if self.path is None:
            return {}
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            verdicts = {entry: (str(v["form"]), str(v["why"])) for entry, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            LOG.warning("ignoring the kept verdicts in %s: %s", self.path, exc)
            return {}
        self.loaded = len(verdicts)
        return verdicts

    def store(self, entry: str, form: str, why: str) -> None:
        """Keep one verdict beside the others in the file (another process's included)."""
        if self.path is None:
            return
        kept: dict[str, Any] = {k: {"form": f, "why": w} for k, (f, w) in self.load().items()}
        kept[entry] = {"form": form, "why": why}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(kept, indent=1).encode())
            self.stored += 1
        except OSError as exc:
            LOG.warning("could not keep a fast-form verdict in %s: %s", self.path, exc)
