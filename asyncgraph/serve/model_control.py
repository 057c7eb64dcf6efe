"""Model control: Triton's model repository extension (index, load, unload) over a
`ModelRepository` (repository.py), and the hot reload behind it.

    app = create_app({}, close_executors=False)
    control = add_model_control(app, ModelRepository("models/"), load, explicit=True)
    control.preload(["encoder"])          # --load-model encoder (blocking, before serving)

`load(path) -> Executor` builds a model's Executor (the CLI's: `asyncgraph.load` with the
command's ExecutorConfig); serve/ sits below loading/, so it is handed in. A model whose
config.pbtxt sets ExecutorConfig fields (pbtxt.py: `batching`, `max_concurrent_executions`) is
built with `load(path, **those_fields)`, and served under the names its `input` and `output`
entries give.

Modes, as Triton's `--model-control-mode`: `explicit` (load and unload by request; nothing is
loaded at start but the models named) or not (`none`: every model of the repository is
loaded at start, and load and unload requests are refused with Triton's 503 UNAVAILABLE
"explicit model load / unload is not allowed if polling is enabled"). Without a repository
the endpoints answer as in `none`, the index listing the models served.

A load reads the model's folder again and applies its version policy: versions that left it
are unloaded, new ones loaded, one whose file changed (`_FileStamp`: its identity, else its
bytes) is reloaded, the others stay as they are. No request fails because of it:

- A version arriving in place of one leaving (a new latest version) whose program is the
  leaving one's with other weights (the same graph, its control-flow subgraphs included, the
  same inputs, outputs, weight names and shapes: `_same_program`) is a hot swap: the leaving
  version's Executor takes the new weights and serves on as the new version, its admission
  gate and measurements kept. Every swap of a load is prepared first (`prepare_weights`:
  checked and folded on a thread, seen by nothing), then all of them are committed and the
  routing republished in one step of the loop, so no request labelled with one version runs
  on another's weights while the others fold. Executions running finish on the old weights;
  a request that took the old version but had not started executing at the commit runs on
  the new ones and is labelled with the new version: an answer's label is the version whose
  weights made it (`Served.label`, by the weights version the execution ran on).
- Any other version is built beside the serving ones: loaded on a thread (a .pt2 takes
  seconds), its gate calibrated, then published in one step. Requests that had already
  taken the old version (they hold its admission gate: counted from their lookup on, with no
  await between) finish on it; once its gate is empty its Executor is closed.
- An unload takes the model out of routing at once (new requests get 404) and answers once
  its requests in flight have finished and its Executors are closed.

Loads and unloads of one model run one at a time, in the order they came.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette

from asyncgraph.graph.archive import is_compiled_package
from asyncgraph.graph.ir import Graph, Ref, target_name
from asyncgraph.runtime.executor import Executor
from asyncgraph.runtime.weights import PreparedWeights
from asyncgraph.serve.admission import Admission, capacity_for
from asyncgraph.serve.calibration import calibrate as calibrate_model
from asyncgraph.serve.codec import decode_request, encode_response
from asyncgraph.serve.core import NOT_ALLOWED, InferenceServer, Served
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.failures import describe
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.serve.names import version_number
from asyncgraph.serve.pbtxt import ConfigError, apply_settings
from asyncgraph.serve.repository import ModelRepository, RepositoryError

logger = logging.getLogger("asyncgraph.serve")

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
UNLOADING = "UNLOADING"

#: How often a retiring version's gate is looked at until its last request has left it.
RETIRE_POLL_S = 0.005
#: At shutdown, how long retiring versions get to drain before their Executors are closed.
RETIRE_AT_CLOSE_S = 30.0

Loader = Callable[..., Executor]  # (path, **ExecutorConfig fields a config.pbtxt sets)


@dataclass(slots=True)
class _Version:
    number: int
    path: Path
    stamp: _FileStamp  # what its file held when loaded: a reload if that changes
    served: Served


@dataclass(slots=True)
class _Swap:
    """An arriving version that goes into a leaving version's Executor: its weights prepared
    (checked and folded on a thread, seen by nothing), then committed with every other swap of
    the load and the routing, in one step (`ModelControl._commit`)."""

    number: int
    path: Path
    stamp: _FileStamp
    into: _Version  # the leaving version whose Executor takes the weights
    source: Executor  # built from the arriving file to read its weights: closed, never served
    prepared: PreparedWeights | None = None


@dataclass(slots=True)
class _Arrival:
    """A load's arriving versions before anything serving changed."""

    built: dict[int, _Version]  # on Executors of their own, calibrated
    swaps: list[_Swap]  # prepared, to commit


class ModelControl:
    """The loaded versions of a repository's models, and their loads and unloads."""

    def __init__(
        self,
        server: InferenceServer,
        repository: ModelRepository,
        load: Loader,
        *,
        explicit: bool = False,
        calibrate: bool = True,
    ) -> None:
        if not isinstance(server.models, dict):
            raise TypeError("model control needs the app's models as a dict it may fill")
        self.server = server
        self.repository = repository
        self.load_executor = load
        self.explicit = explicit
        self.calibrate = calibrate
        self.loaded: dict[str, dict[int, _Version]] = {}
        self.state: dict[str, tuple[str, str]] = {}  # a model without loaded versions
        self._models: dict[str, Executor] = server.models
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._actions: set[asyncio.Task[None]] = set()  # loads and unloads running
        self._calibrated: set[int] = set()  # id() of the gates calibrated
        self._orphans: list[Executor] = []  # built by a preload that failed: closed at the end
        self.changes = Counter(
            "asyncgraph_model_changes", "Model control actions by model and kind: load (a "
            "version built), swap (a hot swap of weights), unload (a version closed), failure "
            "(a load that failed).", ["model", "kind"], registry=server.metrics.registry,
        )
        server.metrics.registry.register(_StateCollector(self))
        server.metrics.live.version_of = self._default_version

    # -- lookups (InferenceServer.served delegates here) ------------------------------------

    def served(self, name: str, version: str | None = None) -> Served:
        versions = self.loaded.get(name)
        if not versions:
            if self.repository.has(name):
                state, reason = self.state.get(name, (UNAVAILABLE, "not loaded"))
                raise ProtocolError(
                    f"model {name!r} is not ready: {state.lower()}"
                    + (f" ({reason})" if reason else "") + "; it has no loaded version",
                    status=404,
                )
            serving = ", ".join(repr(n) for n in self.loaded) or "none"
            raise ProtocolError(
                f"unknown model {name!r}: not in the model repository {self.repository.root}; "
                f"serving {serving}", status=404,
            )
        if version is None:
            return versions[max(versions)].served
        entry = versions.get(version_number(version))  # a 400 for a malformed version
        if entry is None:
            loaded = ", ".join(str(v) for v in sorted(versions))
            raise ProtocolError(
                f"model {name!r} has no version {version!r} loaded; versions: {loaded}",
                status=404,
            )
        return entry.served

    def not_loaded(self, name: str) -> bool:
        """Whether `name` is a repository model with no version loaded (not ready)."""
        return not self.loaded.get(name) and self.repository.has(name)

    def versions(self, name: str) -> list[str]:
        self.served(name)  # 404 when none
        return [str(v) for v in sorted(self.loaded[name])]

    def index(self, ready: bool = False) -> list[dict[str, str]]:
        """Triton's index: each loaded version READY; a model without one with its state
        (UNAVAILABLE and why, LOADING, UNLOADING) and no version. `ready`: READY ones only."""
        entries: list[dict[str, str]] = []
        for name in sorted(set(self.repository.models()) | set(self.loaded)):
            versions = self.loaded.get(name)
            if versions:
                for number, entry in sorted(versions.items()):
                    closed = entry.served.executor.statistics().closed
                    state = UNAVAILABLE if closed else READY
                    entries.append({"name": name, "version": str(number), "state": state,
                                    "reason": "closed" if closed else ""})
            else:
                state, reason = self.state.get(name, (UNAVAILABLE, "not loaded"))
                entries.append({"name": name, "version": "", "state": state, "reason": reason})
        return [e for e in entries if e["state"] == READY] if ready else entries

    # -- loading ----------------------------------------------------------------------------

    def preload(self, names: Iterable[str]) -> None:
        """Load these models now, blocking (before the server starts): the first error,
        a RepositoryError or the loader's, is raised."""
        for name in names:
            if not self.repository.has(name):
                raise RepositoryError(
                    f"model {name!r}: no folder {self.repository.root / name} in the model "
                    f"repository"
                )
            versions: dict[int, _Version] = {}
            try:
                for number, path in self.repository.selected(name).items():
                    versions[number] = self._build(name, number, path)
            except BaseException:
                self._orphans += [e.served.executor for e in versions.values()]
                raise
            self.loaded[name] = versions
            self._publish(name)
            self.changes.labels(name, "load").inc(len(versions))

    async def start(self) -> None:
        """Calibrate the gates the app's own start did not (versions other than a model's
        default), as versions loaded later are before they take traffic."""
        for versions in list(self.loaded.values()):
            for entry in list(versions.values()):
                await self._calibrate(entry.served)

    async def load(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Load or reload model `name` (Triton's RepositoryModelLoad): 503 unless explicit,
        404 for a model not in the repository, 400 for a bad layout or a failed load (the
        versions serving go on serving)."""
        self._check_allowed()
        for key in parameters or {}:
            raise ProtocolError(
                f"load parameters: {key!r} is not supported (asyncgraph loads the model's "
                f"files as they are; no parameters are accepted)"
            )
        self._check_known(name)
        await self._run(name, self._load)

    async def unload(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Unload model `name` (Triton's RepositoryModelUnload): out of routing at once, then
        answered when its requests in flight have finished and its Executors are closed."""
        self._check_allowed()
        for key in parameters or {}:
            if key != "unload_dependents":  # asyncgraph's models have no dependents
                raise ProtocolError(f"unload parameters: {key!r} is not supported")
        if name not in self.loaded:
            self._check_known(name)
        await self._run(name, self._unload)

    async def _run(self, name: str, action: Callable[[str], Awaitable[None]]) -> None:
        """Run a load or unload of `name` after those before it, to its end even if the
        caller goes away (a client that disconnects or cancels its call): a load half done
        would leave its model LOADING, an unload UNLOADING."""

        async def serialized() -> None:
            async with self._lock(name):
                await action(name)

        task = asyncio.ensure_future(serialized())
        self._actions.add(task)
        task.add_done_callback(_forget(self._actions))
        await asyncio.shield(task)

    async def _unload(self, name: str) -> None:
        versions = self.loaded.pop(name, {})
        if not versions:
            self.state[name] = (UNAVAILABLE, "unloaded")
            return
        self.state[name] = (UNLOADING, "")
        self._publish(name)
        logger.info("model %r: unloading version(s) %s", name,
                    ", ".join(map(str, sorted(versions))))
        try:
            await asyncio.gather(*(self._retire(name, e.served) for e in versions.values()))
        finally:
            self.state[name] = (UNAVAILABLE, "unloaded")

    async def _load(self, name: str) -> None:
        current = self.loaded.get(name, {})
        try:
            wanted = await asyncio.to_thread(self.repository.selected, name)
            keep = await asyncio.to_thread(_unchanged, current, wanted)  # may read the files
        except (RepositoryError, OSError) as exc:
            self._failed(name, str(exc))
            raise ProtocolError(f"failed to load {name!r}: {exc}") from None
        leaving = [current[v] for v in sorted(current, reverse=True) if v not in keep]
        arriving = [v for v in sorted(wanted, reverse=True) if v not in keep]
        if not arriving and not leaving:
            return  # loaded as it is on disk: nothing to do (Triton's reload of the same)
        if not current:
            self.state[name] = (LOADING, "")
        try:
            arrival = await self._arrive(name, wanted, arriving, leaving)
        except Exception as exc:
            self._failed(name, str(exc))
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"failed to load {name!r}: {describe(exc)}", 500) from None
        # nothing awaited from the first commit to the publish: one step of the loop, so that
        # no request labelled with a version runs on another's weights
        swapped = self._commit(name, arrival.swaps)
        self.loaded[name] = dict(sorted({**keep, **arrival.built, **swapped}.items()))
        self.state.pop(name, None)
        self._publish(name)
        reused = {id(swap.into.served.executor) for swap in arrival.swaps}
        for entry in leaving:
            if id(entry.served.executor) not in reused:
                self._retire_later(name, entry.served)
        logger.info("model %r: serving version(s) %s", name,
                    ", ".join(map(str, sorted(self.loaded[name]))))
        await self._close(swap.source for swap in arrival.swaps)  # never started

    async def _arrive(
        self, name: str, wanted: dict[int, Path], arriving: list[int], leaving: list[_Version],
    ) -> _Arrival:
        """The arriving versions, ready to publish: each file stamped and loaded on a thread,
        then each either a swap into a leaving version's Executor (the same program), its
        weights prepared, or a version on an Executor of its own, calibrated. Nothing serving
        changes here: a failure (or a cancellation) closes every Executor the load made and
        leaves the model as it was. The swaps are prepared last, so that little happens
        between a preparation and its commit."""
        loaded: dict[int, tuple[_FileStamp, Executor]] = {}
        try:
            for number in arriving:
                loaded[number] = await asyncio.to_thread(self._read, name, number,
                                                         wanted[number])
            swaps = _match(loaded, wanted, leaving)
            built: dict[int, _Version] = {}
            for number, (stamp, executor) in loaded.items():
                if number not in swaps:
                    built[number] = await self._own(name, number, wanted[number], stamp,
                                                    executor)
            for swap in list(swaps.values()):
                if not await self._prepare(name, swap):
                    del swaps[swap.number]
                    built[swap.number] = await self._own(name, swap.number, swap.path,
                                                         swap.stamp, swap.source)
            _check_swappable(name, swaps.values())
        except BaseException:
            await self._close(executor for _, executor in loaded.values())
            raise
        return _Arrival(built, list(swaps.values()))

    def _read(self, name: str, number: int, path: Path) -> tuple[_FileStamp, Executor]:
        """Version `number`'s file stamped, then loaded (on a thread: a .pt2 takes seconds).
        Stamped first: a change while it loads shows at the next load."""
        try:
            stamp = _FileStamp.of(path)
            return stamp, self._load_file(name, path)
        except Exception as exc:
            raise ProtocolError(
                f"failed to load {name!r} version {number} from {path}: {describe(exc)}"
            ) from None

    async def _prepare(self, name: str, swap: _Swap) -> bool:
        """Prepare `swap`'s weights in its leaving version's Executor (folded on a thread;
        nothing serving changes); False if that fails (not expected: the same names and
        shapes), and the version is then built beside it instead."""
        try:
            swap.prepared = await swap.into.served.executor.prepare_weights(
                swap.source.program.weights, strict=True
            )
        except Exception as exc:
            logger.warning("model %r: version %d could not be swapped into version %d's "
                           "executor (%s); built beside it", name, swap.number,
                           swap.into.number, describe(exc))
            return False
        return True

    def _commit(self, name: str, swaps: list[_Swap]) -> dict[int, _Version]:
        """Put every prepared swap in place, without awaiting: with the publish after it, one
        step of the loop. The Executors were checked open just before (`_check_swappable`), with
        nothing awaited since, so no commit fails and none is left half done."""
        versions: dict[int, _Version] = {}
        for swap in swaps:
            assert swap.prepared is not None
            served = swap.into.served
            weights_version = served.executor.commit_weights(swap.prepared)
            assert served.labels is not None  # every version's Served has them (_serve)
            served.labels[weights_version] = str(swap.number)  # answers made on them
            self.changes.labels(name, "swap").inc()
            logger.info("model %r: version %d hot-swapped into version %d's executor", name,
                        swap.number, swap.into.number)
            versions[swap.number] = _Version(
                swap.number, swap.path, swap.stamp,
                Served(served.executor, served.interface, served.admission, str(swap.number),
                       served.labels),
            )
        return versions

    async def _close(self, executors: Iterable[Executor]) -> None:
        """Close Executors that serve nothing, each in a task of its own that `aclose` waits
        for: a load cancelled while it closes them (at shutdown) leaves none open."""
        tasks = [asyncio.ensure_future(executor.aclose()) for executor in executors]
        for task in tasks:
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        if tasks:
            await asyncio.wait(tasks)

    async def _own(
        self, name: str, number: int, path: Path, stamp: _FileStamp, executor: Executor
    ) -> _Version:
        """Version `number` on an Executor of its own, its gate calibrated."""
        try:
            served = self._serve(name, executor, number)
        except Exception as exc:
            raise ProtocolError(
                f"failed to load {name!r} version {number} from {path}: {describe(exc)}"
            ) from None
        await self._calibrate(served)
        self.changes.labels(name, "load").inc()
        return _Version(number, path, stamp, served)

    def _build(self, name: str, number: int, path: Path) -> _Version:
        stamp = _FileStamp.of(path)  # first: a change while it loads shows at the next load
        executor = self._load_file(name, path)
        try:
            return _Version(number, path, stamp, self._serve(name, executor, number))
        except BaseException:
            self._orphans.append(executor)
            raise

    def _load_file(self, name: str, path: Path) -> Executor:
        """The loader's Executor of `path`, with what the model's config.pbtxt sets."""
        settings = self.repository.settings(name)
        options = settings.executor_options() if settings is not None else {}
        return self.load_executor(path, **options) if options else self.load_executor(path)

    def version_policy(self, name: str) -> dict[str, Any]:
        """Model `name`'s version policy, as its last load applied it (Triton's JSON)."""
        return self.repository.applied.get(name, self.repository.policy).config()

    def _serve(self, name: str, executor: Executor, number: int) -> Served:
        server = self.server
        interface = ModelInterface(name, executor.graph)
        settings = self.repository.settings(name)
        if settings is not None:
            try:
                interface = apply_settings(interface, settings)
            except ConfigError as exc:
                raise RepositoryError(f"model {name!r}: {exc}") from None
        return Served(
            executor,
            interface,
            Admission(
                name, capacity_for(executor.config, executor.batching), server.max_queue,
                server.max_queue_bytes,
                first_burst=executor.config.max_concurrent_executions,
            ),
            str(number),
            # answers are labelled by the weights that made them: a request that took this
            # version and starts after a hot swap into its Executor runs on the new version's
            {executor.weights.version: str(number)},
        )

    async def _calibrate(self, served: Served) -> None:
        """As InferenceServer.calibrate does for one gate, once per gate."""
        if not self.calibrate or id(served.admission) in self._calibrated:
            return
        self._calibrated.add(id(served.admission))
        if served.admission.calibration is not None:
            return
        try:
            calibration = await calibrate_model(
                served.executor, served.interface, decode_request, encode_response,
                clock=served.admission.clock,
            )
        except Exception as exc:
            logger.warning("model %r version %s: admission not calibrated (%s)",
                           served.interface.model, served.version, describe(exc))
            return
        served.admission.calibrate(calibration)

    # -- retiring ---------------------------------------------------------------------------

    async def _retire(self, name: str, served: Served) -> None:
        """Close a version's Executor once the last request that took it has left its gate.
        A request holds the gate from its lookup on (no await between the two)."""
        gate = served.admission
        try:
            # polled: the gate has no idle event, and this runs once per version retired
            while gate.pending or gate.running:  # noqa: ASYNC110
                await asyncio.sleep(RETIRE_POLL_S)
        except asyncio.CancelledError:  # at shutdown, past RETIRE_AT_CLOSE_S: closed anyway
            await served.executor.aclose(cancel=True)
            raise
        await served.executor.aclose()
        self.changes.labels(name, "unload").inc()

    def _retire_later(self, name: str, served: Served) -> None:
        task = asyncio.ensure_future(self._retire(name, served))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def aclose(self) -> None:
        """At the app's end: cancel the loads and unloads running (their caller is gone), let
        retiring versions drain (bounded), then close every Executor."""
        for task in list(self._actions):
            task.cancel()
        await asyncio.gather(*self._actions, return_exceptions=True)
        if self._retiring:
            _, late = await asyncio.wait(set(self._retiring), timeout=RETIRE_AT_CLOSE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for versions in list(self.loaded.values()):
            for entry in versions.values():
                await entry.served.executor.aclose()
        for executor in self._orphans:
            await executor.aclose()

    # -- helpers ----------------------------------------------------------------------------

    def _publish(self, name: str) -> None:
        """Route `name`'s unversioned requests (and the app's models, metrics, readiness) to
        its highest loaded version, or take it out when none is loaded."""
        versions = self.loaded.get(name)
        if versions:
            default = versions[max(versions)].served
            self._models[name] = default.executor
            self.server.publish(name, default)
        else:
            self._models.pop(name, None)
            self.server.publish(name, None)

    def _default_version(self, name: str) -> str:
        versions = self.loaded.get(name)
        return str(max(versions)) if versions else ""

    def _failed(self, name: str, reason: str) -> None:
        self.changes.labels(name, "failure").inc()
        logger.warning("model %r: load failed: %s", name, reason)
        if not self.loaded.get(name):
            self.state[name] = (UNAVAILABLE, reason)

    def _check_allowed(self) -> None:
        if not self.explicit:
            raise ProtocolError(NOT_ALLOWED, 503)

    def _check_known(self, name: str) -> None:
        if not self.repository.has(name):
            raise ProtocolError(
                f"unknown model {name!r}: no folder {self.repository.root / name} in the "
                f"model repository", status=404,
            )

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock


def _forget(tasks: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    """A done callback: drop the task from `tasks`, its error retrieved (its caller, if
    still there, got it through the shield)."""

    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()

    return done


@dataclass(frozen=True, slots=True)
class _FileStamp:
    """What a version's file (or folder) held when it was loaded, to tell at a later load
    whether it changed.

    The modification time and size alone miss a file replaced by one of the same size with its
    time kept (`cp -p`, `rsync -a`, builds with fixed timestamps): utime sets the time back.
    So a change is first looked for in what utime cannot set: the inode and device (a file
    replaced by a rename is another inode) and the change time (ctime: every write, rename onto
    the path, chmod or utime moves it), with size and time. A different identity is a reload,
    without reading the file (a `touch` reloads too: harmless, the same weights swapped in).
    The same identity is not proof: ctime is only as fine as the filesystem's clock (a second
    or coarser on some, a scheduler tick on Linux), so a file rewritten in place within one
    tick of being stamped keeps all of it. Then the content's SHA-256 decides: the file
    streamed through the hash on the load's thread, never the loop's. A load request so reads
    each kept version's file once (often from the page cache; a .pt2 of hundreds of MB takes a
    fraction of a second per version) - paid on an operator's request, not on a timer, as the
    price of never answering a load 200 while the old weights serve.
    """

    identity: tuple[tuple[str, int, int, int, int, int], ...]  # (file, dev, ino, size, ns, ns)
    digest: str  # SHA-256 of the bytes (a folder's: of each file's name and bytes, in order)

    @classmethod
    def of(cls, path: Path) -> _FileStamp:
        """Stamp `path` (blocking: on a thread). The identity first: a change made while the
        bytes are hashed shows as another identity at the next load."""
        identity = _identity(path)
        return cls(identity, _digest(path))

    def holds(self, path: Path) -> bool:
        """Whether `path` still holds what was stamped (blocking: on a thread)."""
        return _identity(path) == self.identity and _digest(path) == self.digest


def _files(path: Path) -> list[Path]:
    """The file itself, or a folder's files (recursively, in name order)."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def _identity(path: Path) -> tuple[tuple[str, int, int, int, int, int], ...]:
    entries = []
    for file in _files(path):
        st = os.stat(file)
        entries.append((str(file.relative_to(path)) if file != path else "", st.st_dev,
                        st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(entries)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in _files(path):
        if file != path:
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _unchanged(current: Mapping[int, _Version], wanted: Mapping[int, Path]) -> dict[int, _Version]:
    """The loaded versions still wanted whose files hold what they were loaded from (blocking:
    the files may be hashed, on a thread)."""
    return {v: e for v, e in current.items()
            if v in wanted and e.path == wanted[v] and e.stamp.holds(wanted[v])}


def _match(
    loaded: Mapping[int, tuple[_FileStamp, Executor]], wanted: Mapping[int, Path],
    leaving: list[_Version],
) -> dict[int, _Swap]:
    """The arriving versions that go into a leaving version's Executor (the same program with
    other weights), one arriving version per leaving Executor, highest first."""
    swaps: dict[int, _Swap] = {}
    free = list(leaving)
    for number, (stamp, executor) in loaded.items():
        match = next((e for e in free
                      if _same_program(e.served.executor, executor, wanted[number])), None)
        if match is not None:
            free.remove(match)
            swaps[number] = _Swap(number, wanted[number], stamp, match, executor)
    return swaps


def _check_swappable(name: str, swaps: Iterable[_Swap]) -> None:
    """Every Executor a swap goes into is still open, checked with nothing awaited until the
    commits: a commit then cannot fail, and none is left half done."""
    closed = sorted(s.into.number for s in swaps if s.into.served.executor.statistics().closed)
    if closed:
        raise ProtocolError(
            f"failed to load {name!r}: the executor of version(s) "
            f"{', '.join(map(str, closed))}, to swap new weights into, was closed during the "
            f"load", 500,
        )


def _same_program(old: Executor, new: Executor, path: Path) -> bool:
    """Whether `new` runs `old`'s program with other weights: the same graph and control-flow
    subgraphs (`_same_graph`), inputs and outputs, and weights of the same names, shapes and
    dtypes. When in doubt, not: a rebuild is always right, while a swap of another program
    would serve the new version's label with the old version's code. A compiled package holds
    native code that may carry its weights: never."""
    if is_compiled_package(path) or old.config != new.config:
        return False
    if old.graph.signature != new.graph.signature:
        return False
    if _weight_specs(old.program.weights) != _weight_specs(new.program.weights):
        return False
    return _same_graph(old.program.graph, new.program.graph)


def _weight_specs(weights: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (tuple(getattr(t, "shape", ())), getattr(t, "dtype", type(t)))
        for k, t in weights.items()
    }


def _same_graph(a: Graph, b: Graph) -> bool:
    """Whether two graphs compute the same thing from their inputs and weights: the same nodes,
    arguments and outputs, the subgraphs in their arguments (torch.cond's branches,
    while_loop's and map's bodies, ...) compared node by node with their attributes, and the
    tensors among them equal, value for value. `Graph.format` is not enough: it prints a
    subgraph as `<GraphModule>`, whatever is in it."""
    tensors_a: list[torch.Tensor] = []
    tensors_b: list[torch.Tensor] = []
    if _graph_structure(a, tensors_a) != _graph_structure(b, tensors_b):
        return False
    return all(_same_tensor(x, y) for x, y in zip(tensors_a, tensors_b, strict=True))


def _graph_structure(graph: Graph, tensors: list[torch.Tensor]) -> Hashable:
    inputs = tuple((s.value, s.kind.value, s.target) for s in graph.signature.inputs)
    nodes = tuple(
        (n.output, n.target_name(), _structure(n.args, tensors), _structure(n.kwargs, tensors),
         n.after, n.placement_hint)
        for n in graph.nodes
    )
    outputs = tuple((o.kind.value, _structure(o.arg, tensors)) for o in graph.signature.outputs)
    return inputs, nodes, outputs


def _structure(obj: Any, tensors: list[torch.Tensor]) -> Hashable:
    """What decides a node argument's meaning, comparable with ==: an fx subgraph's nodes and
    the attributes they read, recursively; a tensor's dtype, shape and device (its values are
    appended to `tensors`, compared apart); anything else its type and repr. Another
    nn.Module runs Python code this cannot see: its identity, so that no two loads compare
    equal (a rebuild)."""
    if isinstance(obj, torch.fx.GraphModule):
        return "subgraph", tuple(_fx_node_structure(obj, n, tensors) for n in obj.graph.nodes)
    if isinstance(obj, torch.nn.Module):
        return "module", type(obj).__qualname__, id(obj)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return "tensor", str(obj.dtype), tuple(obj.shape), str(obj.device), str(obj.layout)
    if isinstance(obj, Ref):
        return "ref", obj.id
    if isinstance(obj, torch.fx.Node):
        return "node", obj.name
    if isinstance(obj, (tuple, list)):
        return type(obj).__name__, tuple(_structure(item, tensors) for item in obj)
    if isinstance(obj, dict):
        return "dict", tuple((repr(k), _structure(v, tensors)) for k, v in obj.items())
    return type(obj).__qualname__, repr(obj)


def _fx_node_structure(
    module: torch.fx.GraphModule, node: torch.fx.Node, tensors: list[torch.Tensor]
) -> Hashable:
    target = node.target if isinstance(node.target, str) else target_name(node.target)
    entry = (node.op, node.name, target, _structure(node.args, tensors),
             _structure(node.kwargs, tensors))
    if node.op in ("get_attr", "call_module"):  # a nested subgraph, a constant: what it holds
        assert isinstance(node.target, str)
        return entry, _structure(_attribute(module, node.target), tensors)
    return entry


def _attribute(module: torch.nn.Module, dotted: str) -> Any:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


class _Missing:
    def __repr__(self) -> str:
        return "<missing attribute>"


_MISSING = _Missing()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, device and values (NaNs make two tensors differ: a rebuild)."""
    try:
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                    and torch.equal(a, b))
    except (RuntimeError, TypeError):  # a layout torch.equal does not take: assume they differ
        return False


class _StateCollector(Collector):
    """asyncgraph_model_state{model,version,state}: 1 per entry of the repository index."""

    def __init__(self, control: ModelControl) -> None:
        self.control = control

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(
            "asyncgraph_model_state", "1 for each model version in the repository index, by "
            "its state (READY, UNAVAILABLE, LOADING, UNLOADING).",
            labels=["model", "version", "state"],
        )
        try:
            entries = self.control.index()
        except OSError:  # the repository folder went away: nothing to list
            entries = []
        for e in entries:
            family.add_metric([e["name"], e["version"], e["state"]], 1)
        return [family]


def add_model_control(
    app: Starlette,
    repository: ModelRepository,
    load: Loader,
    *,
    explicit: bool = False,
    calibrate: bool = True,
) -> ModelControl:
    """Serve `repository`'s models on `app` (from create_app, with a models dict) with Triton's
    model repository extension. Nothing is loaded here: call `preload` with the models to
    serve at start (every one in `none` mode, `repository.models()`); the control closes its
    Executors when the app's lifespan ends."""
    server: InferenceServer = app.state.asyncgraph
    control = ModelControl(server, repository, load, explicit=explicit, calibrate=calibrate)
    server.control = control
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(parent: Starlette) -> AsyncIterator[Any]:
        try:
            async with inner(parent) as state:
                await control.start()
                yield state
        finally:
            await control.aclose()

    app.router.lifespan_context = lifespan
    app.state.model_control = control
    return control
