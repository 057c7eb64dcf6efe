"""check_pt2_archive: inspect a .pt2 file before torch.export.load touches it.

torch.export.load trusts its input. It unpickles weights marked `use_pickle` with
`weights_only=False`, falls back to `weights_only=False` for sample inputs, unpickles opaque
and TorchScript objects, loads AOTInductor shared libraries, `sympify`s (evaluates) symbolic
expressions from the graph JSON, compiles the JSON's `guards_code` with `exec` when
`ep.module()` is called, and resolves any `torch.*` attribute path named as a node's target
(`torch.load`, `torch.ops.load_library`), which the executor would then call.

This module reads the archive without running anything from it and refuses, with a message
naming the member and what is wrong:
- a file that is not a zip, is truncated, or has a corrupt member;
- members outside the known layout (compiled code, TorchScript or opaque objects, legacy
  formats), and paths that escape the archive root;
- a pickle (pickled weight, sample inputs) that uses anything but the opcodes and globals that
  torch's weights_only unpickler accepts, or that is not in torch.save's zip format;
- graph JSON that does not parse, has the wrong schema version, names a node target that is
  not an operator, carries a symbolic expression or guard that is not a plain arithmetic
  expression over symbols and inputs' sizes;
- a weight the signature names but the archive lacks, a payload file that is missing or
  smaller than its tensor, and impossible shapes (negative sizes, zero-byte files claiming
  elements).

A compiled package (asyncgraph/compiled/package.py: the program plus AOTInductor models and a
manifest, `extra/asyncgraph_compiled.json`) holds shared libraries, native code that runs when
loaded. It is refused like any archive with compiled code unless the caller trusts it
(`trust_compiled=True`); then everything else is checked by the rules above, and the compiled
members must be exactly the manifest's segments: `data/aotinductor/aoti_segment_<i>/` holding
one wrapper .so, C++ sources and JSON metadata, nothing else.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import operator
import os
import pickletools
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncgraph.errors import ProgramLoadError

_ROOT_FILES = {"archive_format", "archive_version", "byteorder"}
_REFUSED_DIRS = {
    "data/aotinductor/": "AOTInductor compiled code (a shared library)",
    "data/executorch/": "an ExecuTorch program",
    "data/mtia": "MTIA compiled code",
    "xl_model_weights/": "externally loaded weights",
}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
COMPILED_MANIFEST = "asyncgraph_compiled.json"
_AOTI_DIR = "data/aotinductor/"
_AOTI_MEMBER = re.compile(r"data/aotinductor/(aoti_segment_\d+)/([A-Za-z0-9_.-]+)\Z")
_AOTI_SUFFIXES = (".wrapper.so", ".so", ".cpp", ".json")
TRUST_HINT = (
    "load it with asyncgraph.load(path, trust_compiled=True) (--trust-compiled on the command "
    "line) if you trust where it comes from"
)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\Z")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")


def existing_file(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, or ProgramLoadError when it is a directory or does not exist."""
    p = Path(path)
    if p.is_dir():
        raise ProgramLoadError(f"{p}: is a directory, not a .pt2 file")
    if not p.is_file():
        raise ProgramLoadError(f"{p}: no such file")
    return p


def check_pt2_archive(
    path: str | os.PathLike[str], *, verify_crc: bool = True, trust_compiled: bool = False
) -> None:
    """Raise ProgramLoadError unless `path` is a .pt2 that torch.export.load may safely read.

    Nothing from the file is executed or unpickled. `verify_crc=False` skips reading every
    member to check its CRC (when the caller has run `ZipFile.testzip()` already).
    `trust_compiled=True` accepts the AOTInductor models of a compiled package (native code,
    which the caller then loads), checked against its manifest.
    """
    p = existing_file(path)
    if not zipfile.is_zipfile(p):
        with p.open("rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04":
            raise ProgramLoadError(f"{p}: truncated or corrupt archive (no zip directory)")
        raise ProgramLoadError(f"{p}: not a .pt2 archive (not a zip file)")
    try:
        with zipfile.ZipFile(p) as archive:
            _Checker(p, archive, verify_crc, trust_compiled).run()
    except ProgramLoadError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise ProgramLoadError(f"{p}: truncated or corrupt archive ({exc})") from None
    except Exception as exc:  # zlib.error and friends: the archive is damaged
        raise ProgramLoadError(f"{p}: truncated or corrupt archive ({exc!r})") from None


def is_compiled_package(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a zip holding asyncgraph's compiled-package manifest (nothing is
    checked or loaded; a damaged file is simply not one)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(
                n.endswith("/extra/" + COMPILED_MANIFEST) and n.count("/") == 2
                for n in archive.namelist()
            )
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return False


class _Checker:
    """One archive's checks; `fail` raises with the file name in front."""

    def __init__(
        self, path: Path, archive: zipfile.ZipFile, verify_crc: bool, trust_compiled: bool = False
    ) -> None:
        self.path = path
        self.archive = archive
        self.verify_crc = verify_crc
        self.trust_compiled = trust_compiled
        self.root = ""
        self.members: dict[str, zipfile.ZipInfo] = {}

    def fail(self, message: str) -> ProgramLoadError:
        return ProgramLoadError(f"{self.path}: {message}")

    def read(self, name: str) -> bytes:
        return self.archive.read(self.root + name)

    def run(self) -> None:
        self._layout()
        if self.verify_crc:
            bad = self.archive.testzip()
            if bad is not None:
                raise self.fail(f"archive member {bad!r} is corrupt (CRC mismatch)")
        for required in ("archive_format", "archive_version"):
            if required not in self.members:
                raise self.fail(f"missing member {required!r}: not a .pt2 archive")
        if self.read("archive_format").decode(errors="replace").strip() != "pt2":
            raise self.fail("archive_format is not 'pt2'")
        version = self.read("archive_version").decode(errors="replace").strip()
        if version != "0":
            raise self.fail(f"archive version {version[:20]!r} is not supported (expected '0')")
        models = sorted(
            n[len("models/"):-len(".json")] for n in self.members
            if n.startswith("models/") and n.endswith(".json")
        )
        if "model" not in models:
            raise self.fail("no models/model.json: not a program written by torch.export.save")
        referenced: set[str] = set()
        for model in models:
            referenced |= self._model(model)
        for name in self.members:
            if name.startswith(("data/weights/", "data/constants/")) and name not in referenced:
                raise self.fail(f"member {name!r} is not referenced by any weights config")
        self._compiled_models()

    # -- layout ------------------------------------------------------------------------------

    def _layout(self) -> None:
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
        if rel.startswith(_AOTI_DIR) and self.trust_compiled:
            if not _AOTI_MEMBER.match(rel) or not rel.endswith(_AOTI_SUFFIXES):
                raise self.fail(
                    f"unexpected member {rel!r} in a compiled package (expected "
                    "data/aotinductor/aoti_segment_<i>/ with .so, .cpp and .json files)"
                )
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
        if rel.startswith(("data/weights/", "data/constants/")) and rel.count("/") == 2:
            base = rel.rsplit("/", 1)[1]
            if base.endswith(".pt"):
                raise self.fail(
                    f"member {rel!r} is a legacy pickled state dict, which torch loads "
                    "without weights_only; re-export the program with torch.export.save"
                )
            return
        raise self.fail(f"unexpected member {rel!r} in a .pt2 archive")

    # -- compiled models ---------------------------------------------------------------------

    def _compiled_models(self) -> None:
        """The AOTI members are exactly the manifest's segments, one shared library each."""
        libraries: dict[str, list[str]] = {}
        for rel in self.members:
            match = _AOTI_MEMBER.match(rel)
            if match:
                libraries.setdefault(match.group(1), [])
                if rel.endswith(".so"):
                    libraries[match.group(1)].append(rel)
        manifest_member = "extra/" + COMPILED_MANIFEST
        if not libraries and manifest_member not in self.members:
            return
        if manifest_member not in self.members:
            raise self.fail(f"compiled code without a manifest ({manifest_member} is missing)")
        manifest = self._json(manifest_member)
        segments = manifest.get("segments") if isinstance(manifest, dict) else None
        if not isinstance(segments, list) or not isinstance(manifest.get("platform"), dict):
            raise self.fail(f"{manifest_member}: expected 'segments' and 'platform'")
        names = [self._manifest_segment(manifest_member, s) for s in segments]
        if sorted(names) != sorted(libraries) or len(set(names)) != len(names):
            raise self.fail(
                f"{manifest_member}: lists segments {sorted(names)}, but the archive holds "
                f"compiled models {sorted(libraries)}"
            )
        for name, sos in libraries.items():
            if len(sos) != 1:
                raise self.fail(f"compiled model {name} has {len(sos)} shared libraries, not 1")

    def _manifest_segment(self, where: str, entry: Any) -> str:
        fields = ("name", "nodes", "inputs", "outputs", "contiguous")
        if not isinstance(entry, dict) or any(f not in entry for f in fields):
            raise self.fail(f"{where}: a segment needs {', '.join(fields)}: {entry!r:.200}")
        name = entry["name"]
        if not isinstance(name, str) or not re.fullmatch(r"aoti_segment_\d+", name):
            raise self.fail(f"{where}: invalid segment name {name!r:.100}")
        for key in ("nodes", "inputs", "outputs"):
            items = entry[key]
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise self.fail(f"{where}: {name}.{key} must be a list of names")
        if not entry["nodes"]:
            raise self.fail(f"{where}: {name} has no nodes")
        return name

    # -- one model ---------------------------------------------------------------------------

    def _model(self, model: str) -> set[str]:
        """Check one model's JSON, configs, payloads and sample inputs; return members used."""
        used: set[str] = set()
        graph = self._json(f"models/{model}.json")
        if not isinstance(graph, dict) or not isinstance(graph.get("graph_module"), dict):
            raise self.fail(f"models/{model}.json: not a serialized ExportedProgram")
        self._schema_version(model, graph.get("schema_version"))
        weights_cfg = f"data/weights/{model}_weights_config.json"
        constants_cfg = f"data/constants/{model}_constants_config.json"
        weights = self._payload_config(weights_cfg, "data/weights/", used)
        constants = self._payload_config(constants_cfg, "data/constants/", used)
        used |= {weights_cfg, constants_cfg}
        _GraphJson(self, f"models/{model}.json").check(graph)
        self._signature_weights(model, graph, weights, constants)
        sample = f"data/sample_inputs/{model}.pt"
        if sample not in self.members:
            raise self.fail(f"missing member {sample!r} (the program's sample inputs)")
        if self.members[sample].file_size:
            self._torch_save(sample, self.read(sample))
        return used

    def _json(self, rel: str) -> Any:
        if rel not in self.members:
            raise self.fail(f"missing member {rel!r}")
        try:
            return json.loads(self.read(rel))
        except (ValueError, RecursionError) as exc:
            raise self.fail(f"{rel}: invalid JSON ({str(exc)[:200]})") from None

    def _schema_version(self, model: str, version: Any) -> None:
        from torch._export.serde.schema import SCHEMA_VERSION

        major = version.get("major") if isinstance(version, dict) else None
        if not isinstance(major, int) or (major != SCHEMA_VERSION[0] and major != 0):
            raise self.fail(
                f"models/{model}.json: schema version {version!r} is not supported "
                f"(this torch reads major version {SCHEMA_VERSION[0]})"
            )

    def _payload_config(self, rel: str, directory: str, used: set[str]) -> dict[str, Any]:
        cfg = self._json(rel)
        entries = cfg.get("config") if isinstance(cfg, dict) else None
        if not isinstance(entries, dict):
            raise self.fail(f"{rel}: expected an object with a 'config' mapping")
        for fqn, meta in entries.items():
            where = f"{rel}: {fqn!r}"
            if not isinstance(meta, dict):
                raise self.fail(f"{where}: expected an object")
            file = meta.get("path_name")
            if not isinstance(file, str) or not _FILE_NAME.match(file) or file in (".", ".."):
                raise self.fail(f"{where}: invalid path_name {file!r}")
            member = directory + file
            if member not in self.members:
                raise self.fail(f"{where}: its payload {member!r} is missing from the archive")
            used.add(member)
            if file.startswith("custom_obj_") or file.startswith("opaque_obj_"):
                raise self.fail(
                    f"{where}: a pickled Python/TorchScript object ({member}), which can run "
                    "code when loaded; asyncgraph loads tensors only"
                )
            if directory == "data/constants/" and not file.startswith("tensor_"):
                raise self.fail(f"{where}: unknown constant payload {member!r}")
            if meta.get("use_pickle") is True:
                self._torch_save(member, self.read(member))
            elif meta.get("use_pickle") is False:
                self._raw_tensor(where, member, meta.get("tensor_meta"))
            else:
                raise self.fail(f"{where}: use_pickle must be true or false")
        return entries

    def _raw_tensor(self, where: str, member: str, meta: Any) -> None:
        from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

        if not isinstance(meta, dict):
            raise self.fail(f"{where}: missing tensor_meta")
        code = meta.get("dtype")
        dtype = _SERIALIZE_TO_TORCH_DTYPE.get(code) if type(code) is int else None
        if dtype is None:
            raise self.fail(f"{where}: unknown dtype code {meta.get('dtype')!r}")
        sizes = _ints(meta.get("sizes"))
        strides = _ints(meta.get("strides"))
        offset = _ints([meta.get("storage_offset")])
        if sizes is None or strides is None or offset is None or len(sizes) != len(strides):
            raise self.fail(f"{where}: malformed sizes, strides or storage_offset")
        if any(s < 0 for s in sizes) or any(s < 0 for s in strides) or offset[0] < 0:
            raise self.fail(f"{where}: negative size, stride or storage offset {sizes}")
        numel = math.prod(sizes)
        needed = 0 if numel == 0 else offset[0] + 1 + sum(
            (n - 1) * s for n, s in zip(sizes, strides, strict=True)
        )
        nbytes = self.members[member].file_size
        element = dtype.itemsize
        if nbytes % element:
            raise self.fail(f"{where}: {member} has {nbytes} bytes, not a multiple of {element}")
        if nbytes == 0 and numel != 0:
            raise self.fail(
                f"{where}: {member} is empty but its shape {sizes} has {numel} elements"
            )
        if needed * element > nbytes:
            raise self.fail(
                f"{where}: {member} has {nbytes} bytes, but shape {sizes} with strides "
                f"{strides} needs {needed * element}"
            )

    def _signature_weights(
        self, model: str, graph: dict[str, Any], weights: dict[str, Any],
        constants: dict[str, Any],
    ) -> None:
        signature = graph["graph_module"].get("signature")
        specs = signature.get("input_specs") if isinstance(signature, dict) else None
        if not isinstance(specs, list):
            raise self.fail(f"models/{model}.json: the signature has no input_specs list")
        for spec in specs:
            if not isinstance(spec, dict) or len(spec) != 1:
                raise self.fail(f"models/{model}.json: malformed input spec {spec!r:.100}")
            kind, body = next(iter(spec.items()))
            body = body if isinstance(body, dict) else {}
            if kind in ("parameter", "buffer"):
                name = body.get(f"{kind}_name")
                if name not in weights and name not in constants:
                    raise self.fail(
                        f"the signature names {kind} {name!r}, which is missing from "
                        f"the archive's weights"
                    )
            elif kind == "tensor_constant":
                name = body.get("tensor_constant_name")
                if name not in constants:
                    raise self.fail(
                        f"the signature names tensor constant {name!r}, which is missing "
                        "from the archive's constants"
                    )
            elif kind == "custom_obj":
                raise self.fail("the program takes a custom (TorchScript) object input")

    # -- pickles -----------------------------------------------------------------------------

    def _torch_save(self, member: str, data: bytes) -> None:
        """A torch.save zip whose data.pkl only uses what weights_only accepts."""
        import io

        if not data.startswith(b"PK"):
            raise self.fail(
                f"{member}: a pickle outside torch.save's zip format (legacy torch.save or "
                "plain pickle), which torch would load with the full unpickler"
            )
        try:
            inner = zipfile.ZipFile(io.BytesIO(data))
            names = inner.namelist()
        except zipfile.BadZipFile as exc:
            raise self.fail(f"{member}: corrupt torch.save archive ({exc})") from None
        with inner:
            prefix = names[0].split("/", 1)[0] + "/" if names else ""
            pickles = []
            for name in names:
                rel = name[len(prefix):] if name.startswith(prefix) else None
                if rel is None or not _TORCH_SAVE_MEMBER.match(rel):
                    raise self.fail(
                        f"{member}: unexpected record {name!r} in a torch.save archive "
                        "(TorchScript code and extra pickles are refused)"
                    )
                if rel == "data.pkl":
                    pickles.append(name)
            if len(pickles) != 1:
                raise self.fail(f"{member}: a torch.save archive needs exactly one data.pkl")
            check_weights_only_pickle(inner.read(pickles[0]), f"{self.path}: {member}")


_TORCH_SAVE_MEMBER = re.compile(
    r"(data\.pkl|data/\d+|version|byteorder|\.format_version|\.storage_alignment|"
    r"\.data/version|\.data/serialization_id)\Z"
)

_WEIGHTS_ONLY_OPCODES = frozenset({
    "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
    "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT",
    "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT",
    "LONG_BINPUT", "LONG1", "PROTO", "STOP",
})


def check_weights_only_pickle(data: bytes, where: str = "pickle") -> None:
    """Raise ProgramLoadError unless `data` only uses weights_only opcodes and globals.

    A static scan: nothing is unpickled. The globals allowed are those of torch's
    weights_only unpickler (tensor rebuild functions, storages, dtypes, OrderedDict, ...)
    plus any the user registered with torch.serialization.add_safe_globals.
    """
    from torch import _weights_only_unpickler as wou

    user: dict[str, Any] = wou._get_user_allowed_globals()  # type: ignore[no-untyped-call]
    allowed = set(wou._get_allowed_globals()) | set(user)
    try:
        for opcode, arg, pos in pickletools.genops(data):
            if opcode.name not in _WEIGHTS_ONLY_OPCODES:
                raise ProgramLoadError(
                    f"{where}: pickle opcode {opcode.name} at byte {pos} is not allowed "
                    "(only plain tensors and containers are loaded)"
                )
            if opcode.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                full = _compat_global(module, name)
                if full not in allowed or module in ("os", "sys", "posix", "nt"):
                    raise ProgramLoadError(
                        f"{where}: the pickle references {full!r}, which is not a tensor "
                        "type or rebuild function; refusing to load it (it could run code)"
                    )
            if opcode.name == "STOP":
                return
    except ProgramLoadError:
        raise
    except Exception as exc:
        raise ProgramLoadError(f"{where}: malformed pickle ({exc})") from None
    raise ProgramLoadError(f"{where}: truncated pickle (no STOP opcode)")


def _compat_global(module: str, name: str) -> str:
    """The global a protocol-2 unpickler resolves, after Python 2 name mapping."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _ints(items: Any) -> list[int] | None:
    """[{"as_int": 3}, ...] -> [3, ...]; None when malformed or symbolic."""
    if not isinstance(items, list):
        return None
    out = []
    for item in items:
        value = item.get("as_int") if isinstance(item, dict) else None
        if type(value) is not int:
            return None
        out.append(value)
    return out


# -- the graph JSON ------------------------------------------------------------------------------


class _GraphJson:
    """Node targets, symbolic expressions, range constraints and guards of one model JSON."""

    def __init__(self, checker: _Checker, where: str) -> None:
        self.checker = checker
        self.where = where

    def fail(self, message: str) -> ProgramLoadError:
        return self.checker.fail(f"{self.where}: {message}")

    def check(self, graph: dict[str, Any]) -> None:
        for obj in _walk(graph):
            if "target" in obj and "inputs" in obj and "outputs" in obj:
                target = obj["target"]
                if not isinstance(target, str):
                    raise self.fail(f"node {obj.get('name')!r}: target is not a string")
                self._target(str(obj.get("name")), target)
            expr = obj.get("expr_str")
            if expr is not None and (not isinstance(expr, str) or not _safe_sym_expr(expr)):
                raise self.fail(
                        f"symbolic expression {str(expr)[:120]!r} is not a plain arithmetic "
                        "expression over symbols; refusing it (torch would evaluate it)"
                    )
        ranges = graph.get("range_constraints", {})
        if not isinstance(ranges, dict):
            raise self.fail("range_constraints is not a mapping")
        for key in ranges:
            if not _safe_sym_expr(key):
                raise self.fail(
                    f"range constraint {key[:120]!r} is not an expression over symbols"
                )
        guards = graph.get("guards_code", [])
        if not isinstance(guards, list):
            raise self.fail("guards_code is not a list")
        for guard in guards:
            if not isinstance(guard, str) or not _safe_guard(guard):
                raise self.fail(
                    f"guard {str(guard)[:120]!r} is not a comparison of input sizes and "
                    "constants; refusing it (torch would compile it with exec)"
                )

    def _target(self, node: str, target: str) -> None:
        resolved = _resolve_target(target)
        if resolved is _UNRESOLVED:
            return  # stays a string; the importer reports it as an unsupported op
        if not _is_safe_target(resolved):
            raise self.fail(
                f"node {node!r}: target {target!r} is not an operator; refusing a program "
                "that would call it"
            )


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_UNRESOLVED = object()


def _resolve_target(target: str) -> Any:
    """What torch's deserialize_operator turns `target` into, resolved the same way."""
    import torch

    if target.startswith("#"):
        return target  # an extension operator: refused below (not an operator object)
    if target.startswith("_operator"):
        obj: Any = operator
    elif target.startswith("torch"):
        obj = torch
    elif target.startswith("math"):
        obj = math
    else:
        return _UNRESOLVED
    for part in target.split(".")[1:]:
        if part.startswith("__"):
            return target  # refused: no dunder walks
        if not hasattr(obj, part):
            return _UNRESOLVED
        obj = getattr(obj, part)
    return obj


def _is_safe_target(obj: Any) -> bool:
    import torch

    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                        torch._ops.HigherOrderOperator)):
        return True
    return any(obj is f for f in _safe_functions())


def _safe_functions() -> list[Any]:
    import torch

    fns: list[Any] = [
        getattr(operator, n) for n in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
            "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert",
            "lshift", "rshift", "truth",
        )
    ]
    fns += [getattr(math, n) for n in ("ceil", "floor", "trunc", "sqrt", "log", "exp")]
    fns += [getattr(torch, n) for n in dir(torch) if n.startswith(("sym_", "_sym_"))]
    fns += [getattr(torch, n, None) for n in ("_check", "_check_is_size", "_assert")]
    fns.append(torch._C._set_grad_enabled)
    autocast = torch.amp.autocast_mode
    fns += [getattr(autocast, "_enter_autocast", None), getattr(autocast, "_exit_autocast", None)]
    return [f for f in fns if f is not None]


# -- expressions ---------------------------------------------------------------------------------

_SYMPY_CALLS = frozenset({
    "Symbol", "Dummy", "Integer", "Float", "Rational", "Max", "Min", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
    "Unequality", "And", "Or", "Not", "Xor", "Abs", "floor", "ceiling", "sqrt", "Pow", "Mul",
    "Add", "Mod", "Piecewise", "ITE", "Sum",
    # torch.utils._sympy.functions
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt",
    "RoundDecimal", "ToFloat", "Identity", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or",
    "BitwiseFn_bitwise_xor", "OpaqueUnaryFn_sqrt", "OpaqueUnaryFn_exp", "OpaqueUnaryFn_log",
    "OpaqueUnaryFn_log2", "OpaqueUnaryFn_cos", "OpaqueUnaryFn_sin", "OpaqueUnaryFn_tan",
    "OpaqueUnaryFn_cosh", "OpaqueUnaryFn_sinh", "OpaqueUnaryFn_tanh", "OpaqueUnaryFn_acos",
    "OpaqueUnaryFn_asin", "OpaqueUnaryFn_atan", "OpaqueUnaryFn_asinh",
})
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "pi", "E", "I", "int_oo"})
_ASSUMPTIONS = frozenset({
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
    "infinite", "nonzero", "zero", "rational", "even", "odd", "commutative", "prime",
    "composite", "extended_real", "precision",
})
_BUILTIN_NAMES = frozenset(dir(builtins))
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
          ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor)


def _parse(text: str) -> ast.expr | None:
    if len(text) > 10_000:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _symbol_name(name: str) -> bool:
    return bool(_IDENT.match(name)) and "__" not in name


def _safe_sym_expr(text: str) -> bool:
    """A sympy expression built from allowlisted constructors, symbols and numbers only."""
    tree = _parse(text)
    return tree is not None and _sym_node(tree)


def _sym_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    if isinstance(node, ast.Name):
        if node.id in _SYMPY_NAMES or node.id in _SYMPY_CALLS:
            return True
        return _symbol_name(node.id) and node.id not in _BUILTIN_NAMES
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH) and _sym_node(node.left) and _sym_node(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Not, ast.Invert)) and _sym_node(
            node.operand
        )
    if isinstance(node, ast.Compare):
        return _sym_node(node.left) and all(_sym_node(c) for c in node.comparators)
    if isinstance(node, ast.BoolOp):
        return all(_sym_node(v) for v in node.values)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _SYMPY_CALLS:
            return False
        for kw in node.keywords:
            if kw.arg not in _ASSUMPTIONS or not isinstance(kw.value, ast.Constant):
                return False
            if type(kw.value.value) not in (bool, int):
                return False
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if node.func.id in ("Symbol", "Dummy") and _symbol_name(arg.value):
                    continue
                if node.func.id in ("Float", "Integer", "Rational") and _NUMBER.match(arg.value):
                    continue
                return False
            if not _sym_node(arg):
                return False
        return True
    return False


_GUARD_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})
_GUARD_NAMES = frozenset({"L", "math", "inf", "True", "False", "None"})
_GUARD_CALLS = frozenset({"max", "min", "abs", "int", "float", "round", "bool"})
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf", "isfinite",
                         "inf", "nan", "log", "exp", "pow"})


def _safe_guard(text: str) -> bool:
    """A guard such as `L['x'].size()[0] == L['y'].size()[0]` and nothing more."""
    tree = _parse(text)
    return tree is not None and _guard_node(tree)


def _guard_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return _symbol_name(value)
        return value is None or type(value) in (int, float, bool)
    if isinstance(node, ast.Name):
        return node.id in _GUARD_NAMES
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "math":
            return node.attr in _GUARD_MATH
        return node.attr in _GUARD_ATTRS and _guard_node(node.value)
    if isinstance(node, ast.Subscript):
        return _guard_node(node.value) and _guard_node(node.slice)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            callable_ok = func.id in _GUARD_CALLS
        elif isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == "math":
                callable_ok = func.attr in _GUARD_MATH
            else:
                callable_ok = func.attr in _GUARD_ATTRS and _guard_node(func.value)
        else:
            callable_ok = False
        return callable_ok and not node.keywords and all(_guard_node(a) for a in node.args)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH) and _guard_node(node.left) and _guard_node(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)) and _guard_node(node.operand)
    if isinstance(node, ast.Compare):
        return _guard_node(node.left) and all(_guard_node(c) for c in node.comparators)
    if isinstance(node, ast.BoolOp):
        return all(_guard_node(v) for v in node.values)
    return False
