"""Model names and versions as clients send them, checked before anything looks them up.

Every entry point that takes a model name or version from a client (the HTTP routes, the gRPC
calls and stream, `InferenceServer.served`, model control's lookups, `ModelRepository.has`)
checks it here first, so a name or version no model can have never reaches a dict lookup,
`int()` or the file system:

- a version is a number, 1 to 19 ASCII digits (no sign, no spaces) that fits int64, as
  Triton's versions do: `str.isdigit` says yes to `²` and to 5,000 digits, which `int()`
  refuses;
- a name is one folder name of a model repository: not empty, not `.` or `..`, no `/`, `\\`
  or NUL, at most `MAX_NAME_BYTES` bytes as UTF-8 (longer, the file system refuses it with
  ENAMETOOLONG).

A malformed name or version is refused with 400 (gRPC INVALID_ARGUMENT), as Triton refuses a
version string that is not an integer; a well-formed one that is not served is the lookup's
404 (NOT_FOUND). Both transports answer the same and count the refusal in the metrics
(`asyncgraph_unserved_requests_total{route,code}`). Messages show a hostile value shortened.
"""

from __future__ import annotations

from asyncgraph.serve.errors import ProtocolError

#: The longest model name in bytes (UTF-8): a model is a folder of its repository, and
#: Linux's file systems refuse a longer folder name (NAME_MAX).
MAX_NAME_BYTES = 255
#: The most digits of a version: int64's largest value has 19.
MAX_VERSION_DIGITS = 19
#: The largest version (int64, as Triton's).
MAX_VERSION = 2**63 - 1
#: Characters of a client's value an error message shows.
SHOWN_CHARS = 40

#: What a model name may not hold: a path separator (of any platform) or NUL.
_SEPARATORS = ("/", "\\", "\0")


def shown(value: str) -> str:
    """A client's name or version for a message or a log line: its repr, shortened."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def version_number(version: str) -> int:
    """The number of a model version string, or a 400 naming what a version must be."""
    if (
        0 < len(version) <= MAX_VERSION_DIGITS and version.isascii() and version.isdigit()
        and int(version) <= MAX_VERSION
    ):
        return int(version)
    raise ProtocolError(
        f"model version {shown(version)}: expected 1 to {MAX_VERSION_DIGITS} ASCII digits, "
        f"a number from 0 to {MAX_VERSION}"
    )


def check_version(version: str | None) -> str | None:
    """`version` as given (None: the model's default), or a 400 if it is not a number."""
    if version is not None:
        version_number(version)
    return version


def check_name(name: str) -> str:
    """`name` as given, or a 400 saying why no model can have it."""
    if not name:
        raise ProtocolError("model name: empty; expected the name of a model")
    if len(name) > MAX_NAME_BYTES or len(_utf8(name)) > MAX_NAME_BYTES:
        raise ProtocolError(
            f"model name {shown(name)}: {len(_utf8(name))} bytes (UTF-8), over the limit of "
            f"{MAX_NAME_BYTES} (a model name is a folder name of its repository)"
        )
    if name in (".", ".."):
        raise ProtocolError(
            f"model name {name!r}: not a model name ({name!r} names a folder, not a model)"
        )
    for separator in _SEPARATORS:
        if separator in name:
            raise ProtocolError(
                f"model name {shown(name)}: holds {separator!r}; a model name is one folder "
                f"name, without '/', '\\' or NUL"
            )
    return name


def _utf8(text: str) -> bytes:
    # surrogatepass: a lone surrogate (from a lenient decoder) is measured, never an error
    return text.encode("utf-8", "surrogatepass")
