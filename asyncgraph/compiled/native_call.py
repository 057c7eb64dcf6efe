"""A GIL-free call into a compiled segment: the AOTInductor model's C entry points via ctypes.

torch's binding (`torch._C._aoti.AOTIModelPackageLoader.run`, torch 2.11-2.13) holds the GIL
for the whole run of the model, so a segment on a worker thread stalls the event loop and
every other worker. The model's .so exports a C ABI (torch/csrc/inductor/aoti_runtime/
interface.h) that the binding itself calls: `AOTInductorModelContainerCreateWithDevice`,
`...Run`, `...Delete`, the constant-buffer updates and `...RunConstantFolding`. A ctypes call
releases the GIL for its duration, so calling `...Run` through ctypes runs the segment beside
the loop and the other workers.

What this layer does, and why each step is safe:

* `NativeModel.load` extracts the segment's .so from the package and dlopens it (RTLD_LOCAL,
  as torch's runner does). It refuses (NativeUnavailable: the caller falls back to the
  binding) when a C entry point is missing, when the model is not a CPU model, or when the
  segment has an extern-kernel .json (it would need torch's proxy executor, which has no C
  constructor). The constants are inside the .so (our packages never store them apart).
* `NativeContainer.run` turns the input tensors into new AtenTensorHandles
  (`torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors`; `...Run` steals them) and the
  output handles back into tensors (`alloc_tensors_by_stealing_from_void_ptrs`). The input
  and output counts are checked here first: the C function checks them *outside* its
  exception guard, so a wrong count would abort the process instead of returning an error.
  A non-zero AOTIRuntimeError becomes SegmentCallError naming the segment (with
  `AOTInductorGetLastError`'s message where the model has it, torch 2.13; torch 2.11 models
  print the cause to stderr only).
* `load_constants` (swap_weights) mirrors the binding's: a copy into the container's own
  buffer with `...UpdateConstantBufferPairs` (torch 2.13 models), then
  `...RunConstantFolding` refolds what inductor derives from the weights, inside the load (on
  the swapping thread), not in the next call. The AOTI container takes its exclusive lock for
  that; the delegate never loads a container a call runs on. Models built by torch 2.11 have
  that update only in its `std::unordered_map` form, which ctypes cannot build. Their other
  update, `...UpdateUserManagedConstantBufferPairs`, points the model at the caller's tensors
  and never frees the handle it makes of each; a container with staging tensors of its own
  behind it was built and measured, and its process grew by more than the weights' size per
  swap (glibc arena free space never reused; the binding's swaps stay flat), so it is not
  used: on such a model a container's first swap moves it to torch's binding
  (`make_binding`), which loads the weights and runs every later call, GIL held, and the
  native container is deleted.

`CheckedContainer` is the first container of a segment: its first call also runs torch's
binding on the same inputs and compares the outputs exactly (the same code and constants must
give the same bits); a mismatch switches the segment to the binding for good, and says why in
the delegate's statistics. The check uses real inputs because only those are known to be
valid for the segment (token ids in range, sizes in the compiled range). Its verdict is kept
per model .so (by SHA-256) for the life of the process: a later load of the same model calls
it natively, or through the binding, without loading the binding to check again: each load
of a model, by torch's loader or natively, keeps ~0.34 MB the process never gets back
(torch 2.13, a two-Linear model loaded and closed 50 times), and with the check every load
of an Executor kept twice that.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import json
import os
import tempfile
import threading
import weakref
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncgraph.errors import AsyncGraphError

# How compiled segments are called (read at load): "native" (the default: natively, and
# small models through torch's binding on the event loop's thread, loop_call.py),
# "native-only", or "binding" (torch's binding everywhere).
CALL_ENV = "ASYNCGRAPH_AOTI_CALL"

_VOID_P = ctypes.c_void_p
_SIZE_T = ctypes.c_size_t
_ERR = ctypes.c_int32  # AOTIRuntimeError
_SUCCESS = 0
_ALIGNMENT = 64  # AOTI_CONST_ALIGNMENT: constants' data sizes are padded to it

_REQUIRED: dict[str, list[Any]] = {
    "AOTInductorModelContainerCreateWithDevice":
        [ctypes.POINTER(_VOID_P), _SIZE_T, ctypes.c_char_p, ctypes.c_char_p],
    "AOTInductorModelContainerDelete": [_VOID_P],
    "AOTInductorModelContainerRun":
        [_VOID_P, ctypes.POINTER(_VOID_P), _SIZE_T, ctypes.POINTER(_VOID_P), _SIZE_T, _VOID_P,
         _VOID_P],
    "AOTInductorModelContainerGetNumInputs": [_VOID_P, ctypes.POINTER(_SIZE_T)],
    "AOTInductorModelContainerGetNumOutputs": [_VOID_P, ctypes.POINTER(_SIZE_T)],
    "AOTInductorModelContainerGetNumConstants": [_VOID_P, ctypes.POINTER(_SIZE_T)],
    "AOTInductorModelContainerGetConstantName":
        [_VOID_P, _SIZE_T, ctypes.POINTER(ctypes.c_char_p)],
    "AOTInductorModelContainerGetConstantOriginalFQN":
        [_VOID_P, _SIZE_T, ctypes.POINTER(ctypes.c_char_p)],
    "AOTInductorModelContainerGetConstantFromFolded":
        [_VOID_P, _SIZE_T, ctypes.POINTER(ctypes.c_bool)],
    "AOTInductorModelContainerGetConstantDataSize": [_VOID_P, _SIZE_T, ctypes.POINTER(_SIZE_T)],
    "AOTInductorModelContainerGetConstantDtype":
        [_VOID_P, _SIZE_T, ctypes.POINTER(ctypes.c_int32)],
    "AOTInductorModelContainerRunConstantFolding": [_VOID_P, ctypes.c_bool, _VOID_P, _VOID_P],
}
_PAIRS = [_VOID_P, _VOID_P, _SIZE_T, ctypes.c_bool, ctypes.c_bool]  # entries passed as a pointer
_COPY_UPDATE = "AOTInductorModelContainerUpdateConstantBufferPairs"  # torch 2.13 models
_LAST_ERROR = "AOTInductorGetLastError"  # torch 2.13 models

# SHA-256 of a model .so -> how CheckedContainer found its calls: "" agreed with torch's
# binding, else why they did not. Written once per model, read at every load.
_VERDICTS: dict[str, str] = {}
_VERDICTS_LOCK = threading.Lock()


def checked_verdict(digest: str) -> str | None:
    """None when the model of this digest was never checked in this process; "" when its
    native calls agreed with torch's binding; else why they did not."""
    with _VERDICTS_LOCK:
        return _VERDICTS.get(digest)


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = _VOID_P
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [_VOID_P, ctypes.c_char_p, _VOID_P]


class SegmentCallError(AsyncGraphError, RuntimeError):
    """A compiled segment's C entry point returned an error code."""


class NativeUnavailable(Exception):
    """The segment's C entry points cannot be used here; the message says why."""


class _Entry(ctypes.Structure):
    """AOTInductorConstantMapEntry: a constant's name and an AtenTensorHandle."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", _VOID_P)]


def call_mode() -> str:
    """ASYNCGRAPH_AOTI_CALL's value, lower case ("native" when unset)."""
    return os.environ.get(CALL_ENV, "native").strip().lower()


_new_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors  # capsules of at::Tensor*
_steal_outputs = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs


def _handles(tensors: Sequence[Any]) -> list[int]:
    """New AtenTensorHandles of `tensors` (each an owned at::Tensor*: steal or free it)."""
    return [_capsule_pointer(c, None) for c in _new_handles(list(tensors))]


def _steal(handles: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of owned AtenTensorHandles, which are freed."""
    return _steal_outputs([_new_capsule(h, None, None) for h in handles])


# c10::ScalarType codes, as GetConstantDtype gives them (aoti_torch_dtype_*)
_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9,
                torch.complex128: 10, torch.bool: 11, torch.bfloat16: 15}


class NativeModel:
    """One segment's AOTI model .so, dlopened once; it makes the containers."""

    def __init__(self, name: str, library: ctypes.CDLL, digest: str = "") -> None:
        self.name = name
        self.digest = digest  # SHA-256 of the .so: the key of its check's verdict
        self._lib = library
        # ctypes never unloads a library: the model is dlclosed when this object goes, after
        # its containers (each container's finalizer holds the model)
        weakref.finalize(self, _ctypes.dlclose, library._handle)
        for symbol, argtypes in _REQUIRED.items():
            function = getattr(library, symbol)
            function.argtypes, function.restype = argtypes, _ERR
        # None on torch 2.11 models: a swap then moves the container to torch's binding
        self.copy_update = self._optional(_COPY_UPDATE, _PAIRS)
        self._last_error = self._optional(_LAST_ERROR, [ctypes.POINTER(ctypes.c_char_p)])

    def _optional(self, symbol: str, argtypes: list[Any]) -> Any:
        function = getattr(self._lib, symbol, None)
        if function is not None:
            function.argtypes, function.restype = argtypes, _ERR
        return function

    @classmethod
    def load(cls, package: str | os.PathLike[str], segment: str) -> NativeModel:
        """The model of `segment` in a compiled package, or NativeUnavailable."""
        with zipfile.ZipFile(package) as archive:
            members = [n for n in archive.namelist()
                       if f"/data/aotinductor/{segment}/" in n and not n.endswith("/")]
            libraries = [n for n in members if n.endswith(".so")]
            if len(libraries) != 1:
                raise NativeUnavailable(f"{segment}: {len(libraries)} .so files in the package")
            for member in members:
                if member.endswith("_metadata.json"):
                    device = json.loads(archive.read(member)).get("AOTI_DEVICE_KEY", "cpu")
                    if device != "cpu":
                        raise NativeUnavailable(f"{segment}: a {device} model")
                elif member.endswith(".json"):  # extern kernels: torch's proxy executor
                    raise NativeUnavailable(f"{segment}: calls extern kernels "
                                            f"({Path(member).name}), which need torch's proxy "
                                            "executor")
            data = archive.read(libraries[0])
            digest = hashlib.sha256(data).hexdigest()
            with tempfile.TemporaryDirectory(prefix="asyncgraph-native-") as tmp:
                path = Path(tmp) / f"{segment}.so"
                path.write_bytes(data)
                # mapped once opened: the file can go. A fresh path per load gives each load
                # its own copy of the model's static state, as torch's loader does.
                try:
                    library = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
                except OSError as exc:
                    raise NativeUnavailable(f"{segment}: cannot open its model: {exc}") from None
        try:
            return cls(segment, library, digest)
        except AttributeError as exc:  # a required symbol is missing
            raise NativeUnavailable(f"{segment}: {exc}") from None

    def container(self, runners: int = 1,
                  make_binding: Callable[[], Any] | None = None) -> NativeContainer:
        """A new container that can run `runners` calls at once. `make_binding` makes torch's
        binding of the same model: where the model has no copy update (torch 2.11), the
        container's first swap moves it there (without one, such a swap raises)."""
        return NativeContainer(self, runners, make_binding)

    def check(self, code: int, what: str) -> None:
        """Raise SegmentCallError naming the segment for a non-zero AOTIRuntimeError."""
        if code == _SUCCESS:
            return
        detail = "the model printed the cause to stderr"
        if self._last_error is not None:
            message = ctypes.c_char_p()
            if self._last_error(ctypes.byref(message)) == _SUCCESS and message.value:
                detail = message.value.decode(errors="replace")
        raise SegmentCallError(f"{self.name}: {what} failed (AOTIRuntimeError {code}): {detail}")

    def function(self, symbol: str) -> Any:
        return getattr(self._lib, symbol)

    def untyped(self, symbol: str) -> Any:
        """A function object of `symbol` without argtypes (indexing makes a new one, apart
        from the typed attribute): callers pass ctypes objects of the exact C types."""
        function = self._lib[symbol]
        function.restype = _ERR
        return function


class NativeContainer:
    """One AOTInductorModelContainer, called through ctypes with the GIL released.

    It has the AOTIModelPackageLoader methods the delegate uses: run, load_constants,
    get_constant_fqns. Deleted when it is garbage collected, or when a swap moves it to the
    binding."""

    def __init__(self, model: NativeModel, runners: int,
                 make_binding: Callable[[], Any] | None = None) -> None:
        self.model = model
        self._make_binding = make_binding
        self._binding: Any = None  # torch's binding, after a swap on a model without copy
        handle = _VOID_P()
        model.check(model.function("AOTInductorModelContainerCreateWithDevice")(
            ctypes.byref(handle), max(1, runners), b"cpu", None), "creating a container")
        if not handle.value:
            raise SegmentCallError(f"{model.name}: creating a container gave no container")
        self._handle: int = handle.value
        self._delete = weakref.finalize(self, _delete, model, self._handle)
        self.num_inputs = self._count("AOTInductorModelContainerGetNumInputs")
        self.num_outputs = self._count("AOTInductorModelContainerGetNumOutputs")
        # The run's fixed cost, per call: the arguments built once, as ctypes objects, and a
        # handle of the entry point without argtypes (no conversion per argument per call;
        # ~1 us of the ~3 us a call costs over the binding's).
        self._run = model.untyped("AOTInductorModelContainerRun")
        self._call_args = (_VOID_P(self._handle), _SIZE_T(self.num_inputs),
                           _SIZE_T(self.num_outputs))
        self._inputs = _VOID_P * self.num_inputs
        self._outputs = _VOID_P * self.num_outputs
        self._constants = self._read_constants()

    def _count(self, symbol: str) -> int:
        value = _SIZE_T()
        self.model.check(self.model.function(symbol)(self._handle, ctypes.byref(value)), symbol)
        return value.value

    def _read_constants(self) -> dict[str, tuple[bytes, int, int]]:
        """fqn -> (constant name, data size in bytes, dtype code) of the constants the model
        takes (not those it folds from them). Notes whether it folds any (a model compiled
        without runtime folding warns on every fold call) and the bytes of all of them."""
        found = {}
        self._folds = False
        self.constant_bytes = 0  # every constant's, folded ones included (padded)
        for i in range(self._count("AOTInductorModelContainerGetNumConstants")):
            name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
            folded, size, dtype = ctypes.c_bool(), _SIZE_T(), ctypes.c_int32()
            for symbol, out in (("GetConstantName", name), ("GetConstantOriginalFQN", fqn),
                                ("GetConstantFromFolded", folded),
                                ("GetConstantDataSize", size), ("GetConstantDtype", dtype)):
                self.model.check(self.model.function("AOTInductorModelContainer" + symbol)(
                    self._handle, i, ctypes.byref(out)), symbol)
            self._folds |= folded.value
            self.constant_bytes += size.value
            if not folded.value and name.value is not None and fqn.value is not None:
                found[fqn.value.decode()] = (name.value, size.value, dtype.value)
        return found

    @property
    def kind(self) -> str:
        """How calls run: "native", or "binding (why)" after a swap moved it there."""
        if self._binding is None:
            return "native"
        return "binding (swapped on a model without a copy update: torch 2.11)"

    def get_constant_fqns(self) -> list[str]:
        """The weights the model takes as constants (what load_constants accepts)."""
        return list(self._constants)

    @property
    def swaps_natively(self) -> bool:
        """Whether load_constants keeps this container native (False on torch 2.11 models:
        the first swap moves it to torch's binding)."""
        return self._binding is None and self.model.copy_update is not None

    def run(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model's outputs on `args`; the GIL is released while the model runs."""
        if self._binding is not None:
            moved: list[torch.Tensor] = self._binding.run(args)
            return moved
        handle, num_inputs, num_outputs = self._call_args
        if len(args) != num_inputs.value:  # checked by the C side outside its error guard
            raise SegmentCallError(f"{self.model.name}: expected {self.num_inputs} inputs, got "
                                   f"{len(args)}")
        inputs = self._inputs(*[_capsule_pointer(c, None) for c in _new_handles(args)])
        outputs = self._outputs()
        code = self._run(handle, inputs, num_inputs, outputs, num_outputs, None, None)
        if code:
            _steal([h for h in outputs if h])  # none are made on failure; free any that were
            self.model.check(code, "running the model")
        return _steal_outputs([_new_capsule(h, None, None) for h in outputs])

    def load_constants(self, tensors: Mapping[str, torch.Tensor], use_inactive: bool = False,
                       check_full_update: bool = False) -> None:
        """Load `tensors` (fqn -> CPU tensor) into the active constant buffer and refold; the
        binding's load_constants(tensors, False, False). No call may run on the container."""
        if use_inactive or check_full_update:
            raise ValueError("the native container loads the active buffer only")
        for fqn, value in tensors.items():
            self._check_constant(fqn, value)
        if self._binding is None and self.model.copy_update is None:
            self._move_to_binding()
        if self._binding is not None:
            self._binding.load_constants(dict(tensors), False, False)
            return
        self._update(self.model.copy_update, tensors)
        if self._folds:
            self.model.check(self.model.function("AOTInductorModelContainerRunConstantFolding")(
                self._handle, False, None, None), "folding the constants")

    def _move_to_binding(self) -> None:
        """From now on torch's binding runs this container's calls (see the module
        docstring: a torch 2.11 model has no copy update ctypes can call); the native
        container goes. No call runs on it (the delegate's guarantee for a load)."""
        if self._make_binding is None:
            raise SegmentCallError(f"{self.model.name}: the model has no {_COPY_UPDATE} (built "
                                   "by torch 2.11) and no binding to load the constants into")
        self._binding = self._make_binding()
        self._delete()

    def _check_constant(self, fqn: str, value: torch.Tensor) -> None:
        known = self._constants.get(fqn)
        if known is None:
            raise KeyError(f"{self.model.name}: no constant {fqn!r} (it has "
                           f"{sorted(self._constants)})")
        nbytes = value.numel() * value.element_size()
        code = _DTYPE_CODES.get(value.dtype)
        if code is not None and code != known[2]:
            raise ValueError(f"{self.model.name}: constant {fqn} has dtype code {known[2]} "
                             f"(c10::ScalarType), got {value.dtype} (code {code})")
        # the model's size is padded to its blob's alignment (AOTI_CONST_ALIGNMENT, 64 bytes)
        if not 0 <= known[1] - nbytes < _ALIGNMENT or value.device.type != "cpu":
            raise ValueError(f"{self.model.name}: constant {fqn} takes {known[1]} bytes "
                             f"(padded to {_ALIGNMENT}) on the CPU, got {nbytes} on "
                             f"{value.device} (shape {tuple(value.shape)}, {value.dtype})")

    def _update(self, function: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        """One (name, tensor) pairs update; the handles made for it are freed after."""
        names = [self._constants[fqn][0] for fqn in tensors]
        handles = _handles(list(tensors.values()))
        try:
            entries = (_Entry * len(names))(*(_Entry(n, h) for n, h in zip(names, handles,
                                                                           strict=True)))
            self.model.check(function(self._handle, ctypes.addressof(entries), len(names),
                                      False, False), "updating the constants")
        finally:
            _steal(handles)

    def statistics(self) -> dict[str, Any]:
        return {"kind": self.kind, "inputs": self.num_inputs, "outputs": self.num_outputs,
                "constants": len(self._constants)}


def _delete(model: NativeModel, handle: int) -> None:
    """Delete a container (at garbage collection, or when a swap moves it to the binding)."""
    model.function("AOTInductorModelContainerDelete")(handle)


class CheckedContainer:
    """A segment's first native container: its first call is compared with torch's binding
    on the same inputs. `on_mismatch(reason)` is told when they differ; the calls then go to
    the binding. When they agree, `pair(native, reference)` makes what the calls go to (the
    native container with the binding kept beside it, loop_call.py), else the native
    container alone. The verdict is kept under `digest` (the model's; none when ""). Until the
    check, a swap loads both."""

    def __init__(self, native: NativeContainer, reference: Any,
                 on_mismatch: Callable[[str], None] | None = None, digest: str = "",
                 pair: Callable[[NativeContainer, Any], Any] | None = None) -> None:
        self.native = native
        self._digest = digest
        self._reference: Any = reference
        self._on_mismatch = on_mismatch
        self._pair = pair
        self._lock = threading.Lock()
        self._checked = False
        self._chosen: Any = None  # what the calls go to once checked
        self._kind = "native (unchecked)"  # until the check, or "binding (why)" after it
        # rebound to the chosen container's own methods once checked: no layer per call
        self.run: Callable[[list[torch.Tensor]], list[torch.Tensor]] = self._first_run
        self.load_constants: Callable[..., None] = self._load_both

    @property
    def kind(self) -> str:
        """"native" (checked), "native (unchecked)", or "binding (why)"; the pair's when
        one was made."""
        return self._chosen.kind if self._kind == "native" else self._kind

    def get_constant_fqns(self) -> list[str]:
        return self.native.get_constant_fqns()

    def _first_run(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        with self._lock:
            if not self._checked:
                return self._check(args)
        return self.run(args)

    def _check(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        mine = self.native.run(args)
        theirs: list[torch.Tensor] = self._reference.run(args)
        reason = _difference(mine, theirs)
        if self._digest:
            with _VERDICTS_LOCK:
                _VERDICTS[self._digest] = reason or ""
        if reason is None:
            chosen = self.native if self._pair is None else self._pair(self.native,
                                                                       self._reference)
        else:
            chosen = self._reference
        self.run, self.load_constants = chosen.run, chosen.load_constants
        self._chosen, self._checked = chosen, True
        if reason is None:
            self._kind = "native"
            self._reference = None  # its container and copy of the model go, unless paired
            return mine
        self._kind = f"binding ({reason})"
        if self._on_mismatch is not None:
            self._on_mismatch(reason)
        return theirs

    def _load_both(self, tensors: Mapping[str, torch.Tensor], *flags: bool) -> None:
        with self._lock:
            if not self._checked:
                self._reference.load_constants(tensors, *flags)
                self.native.load_constants(tensors, *flags)
                return
        self.load_constants(tensors, *flags)


def _difference(mine: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> str | None:
    """Why the native outputs differ from the binding's, or None when they are equal."""
    if len(mine) != len(theirs):
        return f"{len(mine)} outputs against the binding's {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return (f"output {i} is {tuple(a.shape)} {a.dtype} strides {a.stride()}, the "
                    f"binding's {tuple(b.shape)} {b.dtype} strides {b.stride()}")
        if not torch.equal(a, b) and not (a.is_floating_point()
                                          and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(), b.nan_to_num())):
            return f"output {i} differs from the binding's"
    return None
