"""The server's core, apart from its transports: `InferenceServer`, the state behind HTTP
(app.py) and gRPC (grpc_server.py), and the request path they share.

    server = InferenceServer({"mlp": executor}, timeout_ms=1000)
    served = server.lookup("infer", "mlp")          # 400 / 404, counted
    with served.admission.enter(nbytes, remaining) as ticket:   # 503 if it cannot make it
        ...decode, in the gate's decode lane...
        ran = await server.execute(served, decoded, ticket, deadline)   # slot, run, 504

What lives here: the models served and their lookups (a malformed name or version 400, one
not served 404, names.py; counted by route in asyncgraph_unserved_requests_total), each
model's `Served` (its Executor, interface, admission gate and version label), readiness,
the model repository extension's entry points (delegated to model control,
model_control.py, through `ModelControlHooks`), start-up calibration of the gates
(calibration.py), the limits, `execute` (wait for a slot, run, cancelled at the deadline:
deadlines.py), the response's size check, offloading large decodes and encodes to a thread
(`maybe_offload`) and the metrics (metrics.py). A failure's status and reason are
failures.py's. A transport reads its requests, decodes them with its own codec, and answers
in its own format; neither transport is imported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from asyncgraph.runtime.executor import Executor
from asyncgraph.runtime.weights import weights_ran_on
from asyncgraph.serve import metrics as m
from asyncgraph.serve.admission import Admission, Ticket, capacity_for
from asyncgraph.serve.calibration import calibrate as calibrate_model
from asyncgraph.serve.codec import (
    DEFAULT_MAX_JSON_BYTES,
    InferRequest,
    decode_request,
    encode_response,
    response_bytes,
)
from asyncgraph.serve.deadlines import Deadline
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.failures import describe
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.serve.names import check_name, check_version
from asyncgraph.serve.shared_memory import SystemSharedMemory

logger = logging.getLogger("asyncgraph.serve")

T = TypeVar("T")

#: Triton's answer (UNAVAILABLE, HTTP 503) to a load or unload when model control is off.
NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"

#: Bodies larger than this are decoded and encoded on a thread, so the loop keeps serving.
OFFLOAD_BYTES = 1 << 20

#: Requests that may wait per model beyond the free execution slots: a hard cap for memory,
#: far above a burst a small model drains in time (the deadline decides before it matters).
DEFAULT_MAX_QUEUE = 4096
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
#: Responses larger than this (estimated before encoding, codec.response_bytes) get 400:
#: a response is bounded as a request is (a request for one output 20,000 times got 105 MB).
DEFAULT_MAX_RESPONSE_BYTES = 64 << 20
#: Seconds a request body may take to arrive once its headers came (408 past it): a client
#: that declares a large body and sends it slowly, or never, holds its connection no longer.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Without --max-queue-bytes, waiting request bodies may hold this many maximal bodies.
QUEUE_BYTES_PER_MAX_REQUEST = 4


def default_max_queue_bytes(max_request_bytes: int) -> int:
    """The memory cap on waiting request bodies when none is given."""
    return QUEUE_BYTES_PER_MAX_REQUEST * max_request_bytes


@dataclass(slots=True)
class Served:
    """One model version as the server serves it: its Executor, its protocol interface
    (interface.py), its admission gate (admission.py) and the version its answers are
    labelled with. Model control (model_control.py) makes one per loaded version."""

    executor: Executor
    interface: ModelInterface
    admission: Admission
    version: str | None = None  # a repository's version (model_control.py); None: the app's
    # the version each weights version of the Executor serves as, shared by the Served of
    # one Executor (model control's hot swaps add to it); None: always `version`
    labels: dict[int, str] | None = None

    def label(self, weights_version: int | None) -> str | None:
        """The version an answer made on `weights_version` is labelled with: the one whose
        weights made it, which a hot swap between the lookup and the execution changes."""
        if self.labels is None or weights_version is None:
            return self.version
        return self.labels.get(weights_version, self.version)


class Ran(NamedTuple):
    """One request's execution: outputs, seconds queued and running, and its version label
    (`Served.label` of the weights it ran on)."""

    outputs: list[Any]
    queue_s: float
    compute_s: float
    version: str | None


class ModelControlHooks(Protocol):
    """What the server asks of model control (model_control.ModelControl)."""

    def served(self, name: str, version: str | None = None) -> Served: ...
    def versions(self, name: str) -> list[str]: ...
    def not_loaded(self, name: str) -> bool: ...
    def index(self, ready: bool = False) -> list[dict[str, str]]: ...
    async def load(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...
    async def unload(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...
    def version_policy(self, name: str) -> dict[str, Any]: ...


class InferenceServer:
    """The state behind the transports (HTTP routes, gRPC handlers): models, their queues,
    limits and metrics, and the execution of a decoded request."""

    def __init__(
        self,
        models: Mapping[str, Executor],
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_queue_bytes: int | None = None,
        timeout_ms: float | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        version: str = "1",
        max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_queue_bytes is not None and max_queue_bytes < 0:
            raise ValueError(f"max_queue_bytes must be >= 0, got {max_queue_bytes}")
        if timeout_ms is not None and timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0 (or None for no timeout), got {timeout_ms}")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        if max_json_bytes < 1:
            raise ValueError(f"max_json_bytes must be >= 1, got {max_json_bytes}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.max_json_bytes = max_json_bytes
        self.max_response_bytes = max_response_bytes
        self.body_timeout_s = body_timeout_s
        self.models = models
        self.max_queue = max_queue
        self.max_queue_bytes = (
            default_max_queue_bytes(max_request_bytes) if max_queue_bytes is None
            else max_queue_bytes
        )
        self.timeout_s = None if timeout_ms is None else timeout_ms / 1000
        self.timeout_ms = timeout_ms
        self.max_request_bytes = max_request_bytes
        self.version = version
        self.shutting_down = False
        #: Model control over a repository (model_control.py: add_model_control); None: the
        #: models given, at `version`
        self.control: ModelControlHooks | None = None
        self._served: dict[str, Served] = {}
        self.metrics = m.ServerMetrics(models, self._admission, version)
        #: Triton's system shared memory regions, registered by clients (shared_memory.py)
        self.shared_memory = SystemSharedMemory()
        for name in list(models):
            try:
                check_name(name)
            except ProtocolError as exc:  # no request could name it
                raise ValueError(f"models: {exc.message}") from None
            self.served(name)  # a model that cannot be served fails here, not per request

    # -- models -----------------------------------------------------------------------------

    def served(self, name: str, version: str | None = None) -> Served:
        """Model `name` at `version` (None: its default version): a 400 for a name or version
        no model can have (names.py), a 404 for one not served."""
        self._check(name, version)
        if self.control is not None:
            return self.control.served(name, version)
        ex = self.models.get(name)
        if ex is None:
            serving = ", ".join(repr(n) for n in self.models) or "none"
            raise ProtocolError(f"unknown model {name!r}; serving {serving}", status=404)
        if version is not None and version != self.version:
            raise ProtocolError(
                f"model {name!r} has no version {version!r}; versions: {self.version}",
                status=404,
            )
        served = self._served.get(name)
        if served is None or served.executor is not ex:
            served = Served(
                ex,
                ModelInterface(name, ex.graph),
                Admission(
                    name, capacity_for(ex.config, ex.batching), self.max_queue,
                    self.max_queue_bytes,
                    first_burst=ex.config.max_concurrent_executions,
                ),
            )
            self._served[name] = served
        return served

    def lookup(self, route: str, name: str, version: str | None = None) -> Served:
        """`served`, for a client's request on `route` (infer, metadata): its refusal, a
        malformed name or version (400) or one not served (404), counted in the metrics."""
        with self._counted(route):
            return self.served(name, version)

    def readiness(self, name: str, version: str | None = None) -> bool:
        """Whether model `name` (at `version`) is ready to serve: False for a repository
        model with no version loaded; refused (400, 404) and counted as `lookup` is."""
        with self._counted("ready"):
            self._check(name, version)
            if self.control is not None and self.control.not_loaded(name):
                return False
            self.served(name, version)
        return self.model_ready(name)

    def _check(self, name: str, version: str | None) -> None:
        """A 400 for a name or version no model can have. The app's own `version` is taken
        as it was given (it is the one version a plain app serves, whatever its form)."""
        check_name(name)
        if self.control is not None or version != self.version:
            check_version(version)

    @contextmanager
    def _counted(self, route: str) -> Iterator[None]:
        """A lookup's refusal (ProtocolError: 400, 404) counted by route in the metrics."""
        try:
            yield
        except ProtocolError as exc:
            self.metrics.unserved(route, exc.status)
            raise

    def versions(self, name: str) -> list[str]:
        """The versions of model `name` served (404 for an unknown model)."""
        if self.control is not None:
            return self.control.versions(name)
        self.served(name)
        return [self.version]

    # -- model control (Triton's model repository extension) -------------------------------

    def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """The index; without model control, the models served at the app's version, each
        READY (UNAVAILABLE once its executor is closed)."""
        if self.control is not None:
            return self.control.index(ready)
        entries = [
            {"name": n, "version": self.version,
             "state": "READY" if self.model_ready(n) else "UNAVAILABLE", "reason": ""}
            for n in list(self.models)
        ]
        return [e for e in entries if e["state"] == "READY"] if ready else entries

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        if self.control is None:
            raise ProtocolError(NOT_ALLOWED, 503)  # as Triton when model control is off
        with self._counted("load"):
            check_name(name)
        await self.control.load(name, parameters)

    async def unload_model(
        self, name: str, parameters: Mapping[str, Any] | None = None
    ) -> None:
        if self.control is None:
            raise ProtocolError(NOT_ALLOWED, 503)
        with self._counted("unload"):
            check_name(name)
        await self.control.unload(name, parameters)

    async def calibrate(self) -> None:
        """Calibrate every model's admission gate (calibration.py) before traffic comes; a
        model that cannot be calibrated is logged, once, and predicts nothing until its first
        request completes."""
        for name in list(self.models):
            served = self.served(name)
            try:
                calibration = await calibrate_model(
                    served.executor, served.interface, decode_request, encode_response,
                    clock=served.admission.clock,
                )
            except Exception as exc:  # any failure leaves the gate as it was: uncalibrated
                logger.warning(
                    "model %r: admission not calibrated at start-up (%s); until its first "
                    "request completes, requests with a deadline are admitted only while "
                    "its slots hold them", name, describe(exc) if str(exc) else
                    type(exc).__name__,
                )
                continue
            served.admission.calibrate(calibration)
            logger.info(
                "model %r: admission calibrated in %d round(s): decode %.3f ms (%d-byte "
                "body), execution %.3f ms, encode %.3f ms", name, calibration.rounds,
                calibration.decode_s * 1e3, calibration.body_bytes,
                calibration.execute_s * 1e3, calibration.encode_s * 1e3,
            )

    def _admission(self, name: str) -> Admission | None:
        served = self._served.get(name)
        return served.admission if served is not None else None

    def model_ready(self, name: str) -> bool:
        return not self.shutting_down and not self.models[name].statistics().closed

    # -- the request path the transports share ----------------------------------------------

    def response_size(
        self, name: str, decoded: InferRequest, outputs: list[Any], size: int | None = None
    ) -> int:
        """The response's estimated size (`size`, else codec.response_bytes: what a transport
        encoding otherwise estimates, gRPC's typed contents), or a 400 past
        --max-response-bytes."""
        if size is None:
            size = response_bytes(decoded, outputs)
        if size > self.max_response_bytes:
            raise ProtocolError(
                f"model {name!r}: the response would be up to {size} bytes "
                f"({len(decoded.outputs)} output(s)), over the limit of "
                f"{self.max_response_bytes} bytes (--max-response-bytes); request fewer "
                f"outputs, binary data, or a smaller batch"
            )
        return size

    async def execute(
        self, served: Served, decoded: InferRequest, ticket: Ticket, deadline: Deadline | None
    ) -> Ran:
        """Queue, execute and time one admitted request; cancelled at its deadline.

        A request whose deadline passes while it queues, or has passed when it is handed its
        slot, is answered 504 without running. A client that goes away is the transport's to
        notice: it cancels this (HTTP: app.py's `until_disconnect`; gRPC cancels the RPC's
        task)."""
        model = served.interface.model
        running = False
        queue_s: float | None = None

        async def run() -> Ran:
            nonlocal running, queue_s
            remaining = deadline.remaining() if deadline else None
            async with served.admission.slot(ticket, remaining) as queue_s:
                # checked here, with nothing awaited until the execution starts: a passed
                # deadline's timer fires only at the next await, and an execution that runs
                # straight through (no await) would have run, and answered 200, past it
                if deadline is not None and deadline.passed():
                    raise deadline.exceeded(model, "queued", ran=False, queue_s=queue_s)
                running = True
                started = time.perf_counter()
                outputs = await served.executor.execute_flat(decoded.inputs)
                compute_s = time.perf_counter() - started
                self.metrics.executed(  # Triton's inference count and batch_stats
                    model, served.version, batch_rows(served.executor, decoded.inputs),
                    compute_s,
                )
                return Ran(outputs, queue_s, compute_s,
                           served.label(weights_ran_on()))  # in the task that executed

        if deadline is None:
            return await run()
        try:
            async with asyncio.timeout_at(deadline.at):
                return await run()
        except TimeoutError:
            raise deadline.exceeded(
                model, "running" if running else "queued", ran=running, queue_s=queue_s
            ) from None

    def publish(self, name: str, served: Served | None) -> None:
        """Make `served` model `name`'s default version for the metrics' gates (None: take
        it out): model control's routing (model_control.py), as `served` does for a plain
        app's models."""
        if served is None:
            self._served.pop(name, None)
        else:
            self._served[name] = served


def batch_rows(executor: Executor, inputs: list[Any]) -> int:
    """A request's batch size as Triton counts it (its inference count, statistics.py): its
    rows (dim 0 of its first tensor input) when its Executor batches requests, else 1."""
    if executor.batching_statistics() is None:
        return 1
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return max(1, int(value.shape[0]))
    return 1


async def maybe_offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a thread when its input or output is larger than OFFLOAD_BYTES (a
    large body's decode or a large response's encode), so the loop keeps serving; inline
    otherwise, where a thread's hand-off would cost more than the work."""
    if size > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)

