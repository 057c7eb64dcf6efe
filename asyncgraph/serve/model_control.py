"""Model control: Triton's model repository extension (index, load, unload) over a
`ModelRepository` (repository.py), and the hot reload behind it.

    app = create_app({}, close_executors=False)
    control = add_model_control(app, ModelRepository("models/"), load, explicit=True)
    control.preload(["encoder"])          # --load-model encoder (blocking, before serving)

`load(path) -> Executor` builds a model's Executor (the CLI's: `asyncgraph.load` with the
command's ExecutorConfig); serve/ sits below loading/, so it is handed in.

Modes, as Triton's `--model-control-mode`: `explicit` (load and unload by request; nothing is
loaded at start but the models named) or not (`none`: every model of the repository is
loaded at start, and load and unload requests are refused with Triton's 503 UNAVAILABLE
"explicit model load / unload is not allowed if polling is enabled"). Without a repository
the endpoints answer as in `none`, the index listing the models served.

A load reads the model's folder again and applies its version policy: versions that left it
are unloaded, new ones loaded, one whose file changed is reloaded, the others stay as they are.
No request fails because of it:

- A version arriving in place of one leaving (a new latest version) whose program is the
  leaving one's with other weights (same graph, inputs, outputs, weight names and shapes) is
  a hot swap: the leaving version's Executor takes the new weights with `aswap_weights`
  (executions running finish on the old weights; folding on a thread), and serves on as the
  new version, its admission gate and measurements kept.
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
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette

from asyncgraph.graph.archive import is_compiled_package
from asyncgraph.runtime.executor import Executor
from asyncgraph.serve.admission import Admission, capacity_for
from asyncgraph.serve.app import InferenceServer, _describe, _Served
from asyncgraph.serve.calibration import calibrate as calibrate_model
from asyncgraph.serve.codec import decode_request, encode_response
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.serve.repository import ModelRepository, RepositoryError
from asyncgraph.serve.repository_http import NOT_ALLOWED

logger = logging.getLogger("asyncgraph.serve")

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
UNLOADING = "UNLOADING"

#: How often a retiring version's gate is looked at until its last request has left it.
RETIRE_POLL_S = 0.005
#: At shutdown, how long retiring versions get to drain before their Executors are closed.
RETIRE_AT_CLOSE_S = 30.0

Loader = Callable[[Path], Executor]


@dataclass(slots=True)
class _Version:
    number: int
    path: Path
    stamp: tuple[int, int]  # the file's (mtime_ns, size) when loaded: a reload if it changes
    served: _Served


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

    def served(self, name: str, version: str | None = None) -> _Served:
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
        entry = versions.get(int(version)) if version.isdigit() else None
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
        try:
            wanted = await asyncio.to_thread(self.repository.selected, name)
            stamps = {v: _stamp(p) for v, p in wanted.items()}
        except (RepositoryError, OSError) as exc:
            self._failed(name, str(exc))
            raise ProtocolError(f"failed to load {name!r}: {exc}") from None
        current = self.loaded.get(name, {})
        keep = {v: e for v, e in current.items()
                if v in wanted and e.path == wanted[v] and e.stamp == stamps[v]}
        leaving = [current[v] for v in sorted(current, reverse=True) if v not in keep]
        arriving = [v for v in sorted(wanted, reverse=True) if v not in keep]
        if not arriving and not leaving:
            return  # loaded as it is on disk: nothing to do (Triton's reload of the same)
        if not current:
            self.state[name] = (LOADING, "")
        try:
            built = await self._arrive(name, wanted, stamps, arriving, leaving)
        except Exception as exc:
            self._failed(name, str(exc))
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"failed to load {name!r}: {_describe(exc)}", 500) from None
        reused = {id(e.served.executor) for e in built.values()}
        self.loaded[name] = dict(sorted({**keep, **built}.items()))
        self.state.pop(name, None)
        self._publish(name)
        for entry in leaving:
            if id(entry.served.executor) not in reused:
                self._retire_later(name, entry.served)
        logger.info("model %r: serving version(s) %s", name,
                    ", ".join(map(str, sorted(self.loaded[name]))))

    async def _arrive(
        self, name: str, wanted: dict[int, Path], stamps: dict[int, tuple[int, int]],
        arriving: list[int], leaving: list[_Version],
    ) -> dict[int, _Version]:
        """The arriving versions, ready to publish: each loaded on a thread, then either a
        leaving version's Executor with its weights swapped in (the same program), or its own
        Executor, calibrated. Nothing serving changes until every one has loaded: a failure
        closes what was built and leaves the model as it was. The swaps come last."""
        loaded: dict[int, Executor] = {}
        try:
            for number in arriving:
                try:
                    loaded[number] = await asyncio.to_thread(self.load_executor, wanted[number])
                except Exception as exc:
                    raise ProtocolError(
                        f"failed to load {name!r} version {number} from {wanted[number]}: "
                        f"{_describe(exc)}"
                    ) from None
            swaps: dict[int, _Version] = {}  # arriving version -> the leaving one it swaps into
            free = list(leaving)
            for number in arriving:
                match = next((e for e in free
                              if _same_program(e.served.executor, loaded[number], wanted[number])),
                             None)
                if match is not None:
                    free.remove(match)  # one arriving version per leaving Executor
                    swaps[number] = match
            built: dict[int, _Version] = {}
            for number in arriving:
                if number not in swaps:
                    built[number] = await self._own(name, number, wanted[number], stamps[number],
                                                    loaded[number])
        except BaseException:
            for executor in loaded.values():
                await executor.aclose()
            raise
        for number, entry in swaps.items():
            executor, old = loaded[number], entry.served.executor
            try:
                await old.aswap_weights(executor.program.weights)
            except Exception as exc:  # not expected (the same names and shapes): rebuild
                logger.warning("model %r: version %d could not be swapped into version %d's "
                               "executor (%s); built beside it", name, number, entry.number,
                               _describe(exc))
                try:
                    built[number] = await self._own(name, number, wanted[number],
                                                    stamps[number], executor)
                except BaseException:
                    await executor.aclose()
                    raise
                continue
            await executor.aclose()  # never started: only its threads to stop
            self.changes.labels(name, "swap").inc()
            logger.info("model %r: version %d hot-swapped into version %d's executor", name,
                        number, entry.number)
            served = _Served(old, entry.served.interface, entry.served.admission, str(number))
            built[number] = _Version(number, wanted[number], stamps[number], served)
        return built

    async def _own(
        self, name: str, number: int, path: Path, stamp: tuple[int, int], executor: Executor
    ) -> _Version:
        """Version `number` on an Executor of its own, its gate calibrated."""
        try:
            served = self._serve(name, executor, number)
        except Exception as exc:
            raise ProtocolError(
                f"failed to load {name!r} version {number} from {path}: {_describe(exc)}"
            ) from None
        await self._calibrate(served)
        self.changes.labels(name, "load").inc()
        return _Version(number, path, stamp, served)

    def _build(self, name: str, number: int, path: Path) -> _Version:
        stamp = _stamp(path)
        executor = self.load_executor(path)
        return _Version(number, path, stamp, self._serve(name, executor, number))

    def _serve(self, name: str, executor: Executor, number: int) -> _Served:
        server = self.server
        return _Served(
            executor,
            ModelInterface(name, executor.graph),
            Admission(
                name, capacity_for(executor.config), server.max_queue, server.max_queue_bytes,
                first_burst=executor.config.max_concurrent_executions,
            ),
            str(number),
        )

    async def _calibrate(self, served: _Served) -> None:
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
                           served.interface.model, served.version, _describe(exc))
            return
        served.admission.calibrate(calibration)

    # -- retiring ---------------------------------------------------------------------------

    async def _retire(self, name: str, served: _Served) -> None:
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

    def _retire_later(self, name: str, served: _Served) -> None:
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
            self.server._served[name] = default
        else:
            self._models.pop(name, None)
            self.server._served.pop(name, None)

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


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def _same_program(old: Executor, new: Executor, path: Path) -> bool:
    """Whether `new` runs `old`'s program with other weights: the same graph, inputs and
    outputs, and weights of the same names, shapes and dtypes. A compiled package holds
    native code that may carry its weights: never."""
    if is_compiled_package(path) or old.config != new.config:
        return False
    if old.program.graph.format() != new.program.graph.format():
        return False
    if old.graph.signature != new.graph.signature:
        return False
    return _weight_specs(old.program.weights) == _weight_specs(new.program.weights)


def _weight_specs(weights: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (tuple(getattr(t, "shape", ())), getattr(t, "dtype", type(t)))
        for k, t in weights.items()
    }


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
