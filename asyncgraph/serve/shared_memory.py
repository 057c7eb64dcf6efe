"""Triton's system shared memory extension: inputs read from, and outputs written into, POSIX
shared memory regions a client registers by key.

    client: shm.create_shared_memory_region("in", "/in_key", 32)        (tritonclient)
            client.register_system_shared_memory("in", "/in_key", 32)
            input.set_shared_memory("in", 32)       -> parameters shared_memory_region, ...

A region is the client's POSIX shared memory object `key` (`/dev/shm/<key>`), from `offset`
for `byte_size` bytes, mapped into the server's process when it is registered (the process
owns the mapping; the client owns the object and unlinks it). An input entry naming a region
(`parameters.shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`) has its
bytes copied from there into the input's tensor while the request decodes (codec.py); an
output asked into a region is written there when the answer is encoded, and the answer
carries its name, datatype and shape only. Offsets and sizes are checked against the region,
and every error names the region.

Safety: a request leases each region it names (`Lease`) from its decode until its answer is
made. Unregistering a region in use takes its name away at once (a new region may be
registered under it) and closes its mapping when the last request using it is done: the
requests in flight keep reading and writing the region they were given, never another one,
and nothing they hold is unmapped under them. The number of regions is bounded
(`MAX_REGIONS`), and the bytes a request copies out of regions count against
--max-request-bytes as a body's would.

CUDA shared memory (`/v2/cudasharedmemory`, gRPC CudaSharedMemory*) is refused with a clear
error (`CUDA_REFUSED`): status lists no regions, and unregister has nothing to do.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgraph.serve.errors import ProtocolError

#: The most regions registered at once (Triton sets no bound; perf_analyzer registers one per
#: input and output).
MAX_REGIONS = 256

#: Where POSIX shared memory objects live (Linux).
SHM_ROOT = "/dev/shm"

#: The answer to a CUDA shared memory registration.
CUDA_REFUSED = (
    "CUDA shared memory is not supported by this server: its models' inputs and outputs are "
    "copied through host memory; use system shared memory "
    "(register_system_shared_memory) instead"
)


class Region:
    """One registered region: `byte_size` bytes of shared memory object `key` from `offset`,
    mapped; closed once it is unregistered and no request uses it."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, path: str) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._delta = offset - start
        # not through a link, and only a plain file: a link planted in /dev/shm must not turn
        # the outputs written into a region into writes to any file the server can open
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a shared memory object (not a plain file)")
            self._map: mmap.mmap | None = mmap.mmap(
                fd, self._delta + byte_size, mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE, offset=start,
            )
        finally:
            os.close(fd)
        self.users = 0
        self.registered = True

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Copy `out.nbytes` bytes from `offset` in the region into `out` (uint8)."""
        assert self._map is not None, "read from a closed region"
        start = self._delta + offset
        with memoryview(self._map) as whole, whole[start:start + out.nbytes] as part:
            out[:] = np.frombuffer(part, np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset` in the region."""
        assert self._map is not None, "write into a closed region"
        start = self._delta + offset
        with memoryview(self._map) as whole:
            whole[start:start + len(data)] = data

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    @property
    def closed(self) -> bool:
        return self._map is None


@dataclass(slots=True)
class RegionSlice:
    """The bytes of one input or output in a leased region: `byte_size` from `offset`.
    `where` names the request's field, for errors."""

    region: Region
    offset: int
    byte_size: int
    where: str

    def read_into(self, out: np.ndarray) -> None:
        self.region.read_into(self.offset, out)

    def write(self, data: bytes, output: str) -> None:
        """Write an output's bytes; a 400 naming the region if they do not fit."""
        if len(data) > self.byte_size:
            raise ProtocolError(
                f"{self.where}: output {output!r} takes {len(data)} bytes, more than the "
                f"{self.byte_size} bytes given in shared memory region {self.region.name!r}"
            )
        self.region.write(self.offset, data)


class SystemSharedMemory:
    """The regions registered with one server, by name (see the module docstring)."""

    def __init__(self, max_regions: int = MAX_REGIONS, root: str = SHM_ROOT) -> None:
        self.max_regions = max_regions
        self.root = root
        self._regions: dict[str, Region] = {}
        self._detached: set[Region] = set()  # unregistered while in use
        self._lock = threading.Lock()  # encodes run on threads (core.maybe_offload)

    @property
    def mapped(self) -> int:
        """Regions mapped: registered ones and unregistered ones still in use."""
        with self._lock:
            return len(self._regions) + len(self._detached)

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Map `byte_size` bytes of shared memory object `key` from `offset` as region
        `name` (a client's values, checked here); a 400 naming the region for a name taken,
        a key that is not there, or a range past the object's end."""
        where = f"shared memory region {name!r}"
        if not isinstance(name, str) or not name:
            raise ProtocolError("shared memory region: expected a non-empty name")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise ProtocolError(f"{where}: {field}: expected a non-negative integer, "
                                    f"got {value!r}")
        if byte_size == 0:
            raise ProtocolError(f"{where}: byte_size: expected at least 1 byte, got 0")
        path = self._path(key, where)
        with self._lock:
            if name in self._regions:
                raise ProtocolError(f"{where} is already registered (key "
                                    f"{self._regions[name].key!r}); unregister it first")
            if len(self._regions) + len(self._detached) >= self.max_regions:
                raise ProtocolError(
                    f"{where}: {self.max_regions} regions are mapped already, the most this "
                    f"server maps; unregister some first", 503)
            try:
                size = os.stat(path).st_size
            except OSError:
                raise ProtocolError(
                    f"{where}: no shared memory object with key {key!r}", 400) from None
            if offset + byte_size > size:
                raise ProtocolError(
                    f"{where}: offset {offset} + byte_size {byte_size} bytes is past the end "
                    f"of shared memory object {key!r} ({size} bytes)")
            try:
                region = Region(name, key, offset, byte_size, path)
            except OSError as exc:
                raise ProtocolError(
                    f"{where}: cannot map shared memory object {key!r} "
                    f"({exc.strerror or exc})") from None
            self._regions[name] = region

    def _path(self, key: str, where: str) -> str:
        """The file of POSIX shared memory object `key` ("/name" or "name")."""
        if not isinstance(key, str):
            raise ProtocolError(f"{where}: key: expected a string, got {key!r}")
        bare = key[1:] if key.startswith("/") else key
        if not bare or "/" in bare or bare in (".", "..") or "\0" in bare:
            raise ProtocolError(
                f"{where}: key {key!r} is not a POSIX shared memory name (\"/name\")")
        return os.path.join(self.root, bare)

    def unregister(self, name: str | None = None) -> None:
        """Take region `name` (None: every region) away; a region in use is closed when its
        last request is done. An unknown name is not an error (as Triton's)."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            for each in names:
                region = self._regions.pop(each, None)
                if region is None:
                    continue
                region.registered = False
                if region.users:
                    self._detached.add(region)
                else:
                    region.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """The regions registered (or region `name`: a 404 naming it when there is none)."""
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise ProtocolError(f"shared memory region {name!r} is not registered", 404)
        return [region.status()]

    def close(self) -> None:
        """Unmap every region not in use (the server is stopping)."""
        self.unregister()

    def lease(self, max_input_bytes: int) -> Lease:
        """A request's hold on the regions it names (see `Lease`)."""
        return Lease(self, max_input_bytes)

    # -- leases ------------------------------------------------------------------------------

    def _acquire(self, name: str, where: str) -> Region:
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise ProtocolError(
                    f"{where}: shared memory region {name!r} is not registered")
            region.users += 1
            return region

    def _release(self, region: Region) -> None:
        with self._lock:
            region.users -= 1
            if not region.users and not region.registered:
                self._detached.discard(region)
                region.close()


class Lease:
    """One request's regions: each is acquired when the request's decode names it and
    released by `release` once the answer is made, so the region stays mapped for the request
    whatever is unregistered meanwhile. Inputs copied out of regions may total at most
    `max_input_bytes` (--max-request-bytes)."""

    def __init__(self, memory: SystemSharedMemory, max_input_bytes: int) -> None:
        self.memory = memory
        self.max_input_bytes = max_input_bytes
        self.input_bytes = 0
        self._held: list[Region] = []

    def input(self, name: Any, offset: Any, byte_size: Any, want: int, where: str
              ) -> RegionSlice:
        """The region slice of an input of `want` bytes; a 400 naming the region if it is not
        registered, its size is not `want` or the range is past the region's end."""
        piece = self._slice(name, offset, byte_size, where)
        if piece.byte_size != want:
            raise ProtocolError(
                f"{where}.parameters.shared_memory_byte_size: expected {want} bytes, got "
                f"{piece.byte_size} (shared memory region {name!r})")
        self.input_bytes += want
        if self.input_bytes > self.max_input_bytes:
            raise ProtocolError(
                f"{where}: shared memory region {name!r}: the request's inputs in shared "
                f"memory take {self.input_bytes} bytes, over the limit of "
                f"{self.max_input_bytes} bytes (--max-request-bytes)", 413)
        return piece

    def output(self, name: Any, offset: Any, byte_size: Any, where: str) -> RegionSlice:
        """The region slice an output is written into (its size is checked when written)."""
        return self._slice(name, offset, byte_size, where)

    def _slice(self, name: Any, offset: Any, byte_size: Any, where: str) -> RegionSlice:
        if not isinstance(name, str):
            raise ProtocolError(
                f"{where}.parameters.shared_memory_region: expected a string, got {name!r}")
        if offset is None:
            offset = 0
        for field, value in (("shared_memory_offset", offset),
                             ("shared_memory_byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise ProtocolError(
                    f"{where}.parameters.{field}: expected a non-negative integer, got "
                    f"{value!r} (shared memory region {name!r})")
        region = self.memory._acquire(name, where)
        self._held.append(region)
        if offset + byte_size > region.byte_size:
            raise ProtocolError(
                f"{where}: shared memory region {name!r}: offset {offset} + "
                f"{byte_size} bytes is past its end ({region.byte_size} bytes)")
        return RegionSlice(region, offset, byte_size, where)

    def release(self) -> None:
        """Give every region back (once; again is a no-op)."""
        held, self._held = self._held, []
        for region in held:
            self.memory._release(region)
