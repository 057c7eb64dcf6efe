"""Which pickles in a .pt2 may be loaded: a static scan, nothing is unpickled.

torch.export.load unpickles pickled weights with `weights_only=False` and falls back to it
for sample inputs, so a pickle there can run any code. A pickle is let through only when it is
in torch.save's zip format (one data.pkl, tensor storages, no TorchScript code) and uses only
the opcodes and globals that torch's weights_only unpickler accepts.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from typing import Any

from asyncgraph.errors import ProgramLoadError

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


def check_torch_save(data: bytes, where: str) -> None:
    """Raise ProgramLoadError unless `data` is a torch.save zip whose data.pkl only uses what
    weights_only accepts; `where` (file and member) starts the message."""
    if not data.startswith(b"PK"):
        raise ProgramLoadError(
            f"{where}: a pickle outside torch.save's zip format (legacy torch.save or "
            "plain pickle), which torch would load with the full unpickler"
        )
    try:
        inner = zipfile.ZipFile(io.BytesIO(data))
        names = inner.namelist()
    except zipfile.BadZipFile as exc:
        raise ProgramLoadError(f"{where}: corrupt torch.save archive ({exc})") from None
    with inner:
        prefix = names[0].split("/", 1)[0] + "/" if names else ""
        pickles = []
        for name in names:
            rel = name[len(prefix):] if name.startswith(prefix) else None
            if rel is None or not _TORCH_SAVE_MEMBER.match(rel):
                raise ProgramLoadError(
                    f"{where}: unexpected record {name!r} in a torch.save archive "
                    "(TorchScript code and extra pickles are refused)"
                )
            if rel == "data.pkl":
                pickles.append(name)
        if len(pickles) != 1:
            raise ProgramLoadError(f"{where}: a torch.save archive needs exactly one data.pkl")
        check_weights_only_pickle(inner.read(pickles[0]), where)


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
