"""The persistent cache of exported segments: a restart, or a second replica on the same
machine, skips the exports a first run paid for.

Why: exporting tiny BERT's one ONNX segment takes 1.6 s on 2 cores (most of it building
torch.onnx's registry of ONNX functions, once per process), against 0.09 s to build the same
Executor with the export already in memory. A service that restarts, scales out or reloads a
model would otherwise pay the export again, and serve the plain graph meanwhile.

What: one file per export, `<root>/onnx/<key>.onnx` beside `<key>.json` (OnnxModel's fields
but the bytes), where `key` is a SHA-256 of everything the bytes depend on: the segment's fx
code and input specs, and the versions of asyncgraph, torch, onnx, onnxscript and ONNX Runtime
and the machine's CPU (ONNX Runtime's optimiser and the exporter's choices differ across
them). Weights are not in the key: an exported segment holds none (onnx_export.py bakes them
into each session).

Root and writes: runtime/disk_cache.py's (`$ASYNCGRAPH_CACHE_DIR`, empty turns it off; a
temporary file renamed into place, so a reader never sees half a file). A file that cannot
be read back (truncated, another format) is a miss, never an error: the segment is exported
again and the file rewritten. Unwritable roots only log (the export is
still used, from memory).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import platform
from functools import cache
from typing import Any

from asyncgraph.runtime.disk_cache import ENV, cache_root, cpu_model, digest, write_atomically

LOG = logging.getLogger("asyncgraph.cache")
__all__ = ["ENV", "cache_root", "environment", "key_of", "load", "store"]


@cache
def environment() -> str:
    """The versions and the CPU an export depends on, as one string."""
    parts = [f"python={platform.python_version()}", f"machine={platform.machine()}",
             f"cpu={cpu_model()}"]
    for package in ("asyncgraph", "torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            parts.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package}=none")
    return ";".join(parts)


def key_of(kind: str, *parts: Any) -> str:
    """The cache key of an artefact of `kind` made from `parts` (their reprs) here."""
    return digest(kind, environment(), *parts)


def load(kind: str, key: str, fields: type[Any]) -> Any | None:
    """The cached `fields` dataclass (its bytes field `model` from the .onnx file) or None."""
    root = cache_root()
    if root is None:
        return None
    folder = root / kind
    try:
        meta = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        model = (folder / f"{key}.onnx").read_bytes()
        if len(model) != meta.pop("size"):
            raise ValueError("the model file is not the size written")
        values = {f.name: meta[f.name] for f in dataclasses.fields(fields) if f.name != "model"}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return fields(model=model, **values)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        LOG.warning("ignoring the cached export %s/%s: %s", folder, key, exc)
        return None


def store(kind: str, key: str, value: Any) -> None:
    """Write `value` (a dataclass with bytes `model`) under `key`; logs, never raises."""
    root = cache_root()
    if root is None:
        return
    folder = root / kind
    meta = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name != "model"}
    meta["size"] = len(value.model)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # the model first: the .json says it is whole
        write_atomically(folder / f"{key}.onnx", value.model)
        write_atomically(folder / f"{key}.json", json.dumps(meta).encode())
    except OSError as exc:
        LOG.warning("could not cache an export in %s: %s", folder, exc)

