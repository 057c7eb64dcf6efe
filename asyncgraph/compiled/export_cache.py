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

Root: `$ASYNCGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/asyncgraph`, else `~/.cache/asyncgraph`.
`ASYNCGRAPH_CACHE_DIR=` (empty) turns the cache off. Writes go to a temporary file renamed into
place, so a reader never sees half a file and two processes writing one key both leave a whole
one. A file that cannot be read back (truncated, another format) is a miss, never an error: the
segment is exported again and the file rewritten. Unwritable roots only log (the export is
still used, from memory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

LOG = logging.getLogger("asyncgraph.cache")
ENV = "ASYNCGRAPH_CACHE_DIR"


def cache_root() -> Path | None:
    """Where cached exports live; None when `ASYNCGRAPH_CACHE_DIR` is set empty (off)."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "asyncgraph"


@cache
def environment() -> str:
    """The versions and the CPU an export depends on, as one string."""
    parts = [f"python={platform.python_version()}", f"machine={platform.machine()}",
             f"cpu={_cpu_model()}"]
    for package in ("asyncgraph", "torch", "onnx", "onnxscript", "onnxruntime"):
        try:
            parts.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package}=none")
    return ";".join(parts)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def key_of(kind: str, *parts: Any) -> str:
    """The cache key of an artefact of `kind` made from `parts` (their reprs) here."""
    digest = hashlib.sha256(f"{kind}\n{environment()}".encode())
    for part in parts:
        digest.update(b"\n")
        digest.update(repr(part).encode())
    return digest.hexdigest()


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
        _write(folder / f"{key}.onnx", value.model)  # the model first: the .json says it is whole
        _write(folder / f"{key}.json", json.dumps(meta).encode())
    except OSError as exc:
        LOG.warning("could not cache an export in %s: %s", folder, exc)


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
