"""A model repository on disk, laid out as Triton's, and the version policy that picks what
of it is served.

    DIR/
      encoder/
        1/model.pt2          # version 1: a numbered folder holding model.pt2 (Triton's layout)
        2.pt2                # version 2: or a numbered .pt2 file
        config.json          # optional: {"version_policy": "latest:2"} for this model only
        config.pbtxt         # optional: Triton's model configuration, what applies (pbtxt.py)
      mlp/
        3/model.pt2

One folder per model, named as the model is served; inside it, one entry per version, its
number the folder's or file's name. A version policy (`VersionPolicy`: `latest:N`, `specific:1,3`
or `all`, as Triton's `version_policy`) picks which versions are served; the server's policy
applies to every model without a `config.json` of its own. A `config.pbtxt` (Triton's model
configuration, pbtxt.py) may set the version policy too (not both files), and sets batching,
instances and the served names of inputs and outputs; what of it cannot apply is refused, by
file and field, as any layout error is.

Anything that cannot be read this way is a `RepositoryError` naming the path at fault and what
was expected: a load of that model fails with it, and `asyncgraph serve` refuses to start on it.
The repository is read again at every load, so versions added or removed since count.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgraph.errors import AsyncGraphError
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.names import check_name
from asyncgraph.serve.pbtxt import PBTXT_FILE, ConfigError, ModelSettings, read_settings

#: The file of a version folder (`DIR/<model>/<version>/model.pt2`), as Triton names it.
MODEL_FILE = "model.pt2"
#: A model's own settings: `{"version_policy": "latest:2"}`.
CONFIG_FILE = "config.json"

_NUMBER = re.compile(r"[0-9]+")


class RepositoryError(AsyncGraphError, ValueError):
    """The repository, or one model in it, is not laid out as expected: the message names the
    path and the layout it should have."""


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """Which versions of a model are served: the `latest` N (the highest numbers), the
    `specific` ones listed, or `all`."""

    kind: str = "latest"
    latest: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """`latest:N`, `latest` (N = 1), `specific:1,3` or `all`."""
        kind, _, arg = text.strip().partition(":")
        try:
            if kind == "latest":
                n = int(arg) if arg else 1
                if n < 1:
                    raise ValueError
                return cls("latest", n)
            if kind == "specific":
                versions = tuple(sorted({int(v) for v in arg.split(",")}))
                if not versions or min(versions) < 0:
                    raise ValueError
                return cls("specific", versions=versions)
        except ValueError:
            pass
        if kind == "all" and not arg:
            return cls("all")
        raise ValueError(
            f"version policy {text!r}: expected latest:N (N >= 1), specific:V1,V2,... or all"
        )

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those `available`, ascending. A `specific` version
        that is not there is a RepositoryError (it cannot be served as asked)."""
        if self.kind == "latest":
            return sorted(available)[-self.latest:]
        if self.kind == "specific":
            missing = [v for v in self.versions if v not in available]
            if missing:
                have = ", ".join(map(str, sorted(available))) or "none"
                raise RepositoryError(
                    f"version policy {self}: version(s) {', '.join(map(str, missing))} not in "
                    f"the repository (versions: {have})"
                )
            return list(self.versions)
        return sorted(available)

    def config(self) -> dict[str, Any]:
        """The policy as Triton's model configuration writes it (`version_policy`, JSON)."""
        if self.kind == "latest":
            return {"latest": {"num_versions": self.latest}}
        if self.kind == "specific":
            return {"specific": {"versions": list(self.versions)}}
        return {"all": {}}

    def __str__(self) -> str:
        if self.kind == "latest":
            return f"latest:{self.latest}"
        if self.kind == "specific":
            return "specific:" + ",".join(map(str, self.versions))
        return "all"


class ModelRepository:
    """The models of a repository folder (`root`), read from disk on every call."""

    def __init__(self, root: str | Path, policy: VersionPolicy | None = None) -> None:
        self.root = Path(root)
        self.policy = policy if policy is not None else VersionPolicy()
        #: The policy each model's last selection applied (`selected`)
        self.applied: dict[str, VersionPolicy] = {}
        if not self.root.is_dir():
            raise RepositoryError(
                f"model repository {self.root}: not a folder (expected one folder per model, "
                f"each holding numbered versions: {self.root}/<model>/<version>/{MODEL_FILE} "
                f"or {self.root}/<model>/<version>.pt2)"
            )

    def models(self) -> list[str]:
        """The model names: the repository's folders, sorted (hidden ones left out)."""
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    def has(self, name: str) -> bool:
        """Whether `name` is a model of the repository: a folder of it. A name that cannot be
        a folder name (names.check_name: too long, a separator, NUL), a hidden one, or one
        the file system refuses to look up, is not: never an OSError."""
        if name.startswith("."):
            return False
        try:
            check_name(name)
            return (self.root / name).is_dir()
        except (ProtocolError, OSError, ValueError):
            return False

    def versions(self, name: str) -> dict[int, Path]:
        """Every version of model `name` and its file, or a RepositoryError naming the path."""
        folder = self.root / name
        found: dict[int, Path] = {}
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith(".") or entry.name == CONFIG_FILE:
                continue
            if entry.is_dir():
                if not _NUMBER.fullmatch(entry.name):
                    continue  # not a version (Triton skips such folders too)
                path = entry / MODEL_FILE
                if not path.is_file():
                    raise RepositoryError(
                        f"model {name!r}: version folder {entry} has no {MODEL_FILE} (expected "
                        f"{entry}/{MODEL_FILE})"
                    )
            elif entry.suffix == ".pt2":
                if not _NUMBER.fullmatch(entry.stem):
                    raise RepositoryError(
                        f"model {name!r}: {entry} is not a version (expected a numbered file, "
                        f"{folder}/<version>.pt2, or {folder}/<version>/{MODEL_FILE})"
                    )
                path = entry
            else:
                continue
            version = int(entry.stem if entry.is_file() else entry.name)
            if version in found:
                raise RepositoryError(
                    f"model {name!r}: version {version} is given twice ({found[version]} and "
                    f"{path})"
                )
            found[version] = path
        if not found:
            raise RepositoryError(
                f"model {name!r}: {folder} holds no version (expected {folder}/<version>/"
                f"{MODEL_FILE} or {folder}/<version>.pt2)"
            )
        return found

    def policy_for(self, name: str) -> VersionPolicy:
        """The model's own policy (its config.json's or config.pbtxt's `version_policy`),
        else the server's."""
        config = self.root / name / CONFIG_FILE
        pbtxt = self.settings(name)
        own = pbtxt.version_policy if pbtxt is not None else None
        if not config.is_file():
            return self.policy if own is None else self._pbtxt_policy(name, pbtxt, own)
        try:
            settings = json.loads(config.read_text())
            text = settings.get("version_policy") if isinstance(settings, dict) else None
            if text is None:
                return self.policy if own is None else self._pbtxt_policy(name, pbtxt, own)
            if not isinstance(text, str):
                raise ValueError(f"version_policy: expected a string, got {text!r}")
            policy = VersionPolicy.parse(text)
        except (OSError, ValueError) as exc:
            raise RepositoryError(f"model {name!r}: {config}: {exc}") from None
        if pbtxt is not None and pbtxt.version_policy is not None:
            raise RepositoryError(
                f"model {name!r}: both {config} and {pbtxt.path} set the version policy; "
                f"keep one")
        return policy

    def settings(self, name: str) -> ModelSettings | None:
        """The model's config.pbtxt (pbtxt.py), checked; None without one."""
        path = self.root / name / PBTXT_FILE
        if not path.is_file():
            return None
        try:
            return read_settings(path, name)
        except ConfigError as exc:
            raise RepositoryError(f"model {name!r}: {exc}") from None

    def _pbtxt_policy(self, name: str, pbtxt: ModelSettings | None, text: str) -> VersionPolicy:
        assert pbtxt is not None
        try:
            return VersionPolicy.parse(text)
        except ValueError as exc:
            raise RepositoryError(
                f"model {name!r}: {pbtxt.path}: field 'version_policy' cannot apply: {exc}"
            ) from None

    def selected(self, name: str) -> dict[int, Path]:
        """The versions of `name` its policy serves, and their files (ascending); the policy
        is kept as the model's `applied` one (the configuration's answer, model_config.py)."""
        if not self.has(name):
            raise KeyError(name)
        available = self.versions(name)
        policy = self.policy_for(name)
        chosen = {v: available[v] for v in policy.select(list(available))}
        self.applied[name] = policy
        return chosen
