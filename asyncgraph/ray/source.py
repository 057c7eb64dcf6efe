"""ModelSource: how a .pt2 file reaches the replicas, which may run on other machines.

Two ways, chosen by the caller, because only the caller knows where its files live:

- `ModelSource.shared(path)`: every node reads `path` itself (a shared filesystem, a file
  baked into the image, or a single-machine cluster). Nothing travels but the path.
- `ModelSource.shipped(path)`: the driver reads the file once and puts its bytes in Ray's
  object store; each replica fetches them (once per node, Ray caches objects per node),
  writes them to a private temporary file and loads that. For files that live only on the
  driver.

Either way the replica loads through `asyncgraph.load`, so it refuses a .pt2 that fails the
archive checks (asyncgraph/graph/archive/) exactly as `asyncgraph serve` does: the bytes
that arrive are not trusted because the driver sent them.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgraph.errors import ProgramLoadError
from asyncgraph.loading import load
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.executor import Executor


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A .pt2 file as the replicas will find it: a path they read, or bytes in the object store.

    Attributes:
        path: the file's path on the driver (and, for a shared source, on every node).
        ref: the object store reference of the file's bytes (shipped sources), else None.
        size: the file's size in bytes on the driver (for messages and checks).
        imports: modules each replica imports before loading: those that register the pytree
            types of the program's inputs and outputs (`asyncgraph serve --import`), since a
            replica is a process of its own.
    """

    path: str
    ref: Any = None  # ray.ObjectRef[bytes]; Any so that this module does not import ray
    size: int = 0
    imports: tuple[str, ...] = ()

    @classmethod
    def shared(cls, path: str | os.PathLike[str], imports: tuple[str, ...] = ()) -> ModelSource:
        """A file every node reads at `path` itself."""
        p = Path(path)
        return cls(str(p), None, p.stat().st_size if p.is_file() else 0, imports)

    @classmethod
    def shipped(
        cls, path: str | os.PathLike[str], imports: tuple[str, ...] = ()
    ) -> ModelSource:
        """A file read here once and sent to the replicas through Ray's object store.

        Needs a connected Ray (ray.init); raises ProgramLoadError naming the path if it
        cannot be read.
        """
        import ray

        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise ProgramLoadError(f"{p}: cannot read the model file ({exc})") from None
        return cls(str(p), ray.put(data), len(data), imports)

    @property
    def is_shipped(self) -> bool:
        return self.ref is not None

    def load(self, config: ExecutorConfig, *, trust_compiled: bool = False) -> Executor:
        """The Executor of this file, loaded (and checked) in the calling process."""
        for module in self.imports:
            try:
                importlib.import_module(module)
            except Exception as exc:
                raise ProgramLoadError(
                    f"{self.path}: cannot import {module!r} before loading it ({exc})"
                ) from None
        if not self.is_shipped:
            return load(self.path, config, trust_compiled=trust_compiled)
        import ray

        data: bytes = ray.get(self.ref)
        if len(data) != self.size:
            raise ProgramLoadError(
                f"{self.path}: received {len(data)} bytes from the object store, expected "
                f"{self.size}"
            )
        # the file is only read while loading (weights are copied out of the archive), so it
        # is removed at once; the name keeps the driver's file name for error messages
        with tempfile.TemporaryDirectory(prefix="asyncgraph-model-") as tmp:
            local = Path(tmp) / Path(self.path).name
            local.write_bytes(data)
            del data
            try:
                return load(local, config, trust_compiled=trust_compiled)
            except ProgramLoadError as exc:
                raise ProgramLoadError(
                    f"{self.path} (shipped through the object store): {exc}"
                ) from None
