"""create_app: a Starlette app that serves Executors over the Open Inference Protocol (KServe v2).

    app = create_app({"mlp": executor}, timeout_ms=1000)

The app is plain ASGI, so it runs on uvicorn (`asyncgraph serve`, `asyncgraph.serve.run`) or is
mounted into an existing FastAPI or Starlette app. It does not need its lifespan to have run:
a mounted app's lifespan is never run by its parent. `models` may be a dict the parent fills
and empties in its own lifespan; the app reads it on every request.

One inference request: look the model up (a malformed name or version 400, one not served 404,
names.py; counted by route in asyncgraph_unserved_requests_total) -> enter the model's
admission gate, refused at once (503) if it could not make its deadline or the queue's memory
caps are reached -> read the body within the size limit (413) and --body-timeout-s (408), its
bytes charged to the gate as they arrive -> decode, in the gate's decode lane (one decode per
loop turn, timed), and check every field against the signature (400, nothing allocated for a
bad request; JSON parsed in pieces, codec.py) -> wait for an execution slot -> execute,
cancelled at its deadline (504) or by the client going away -> check the response's estimated
size against --max-response-bytes (400) -> encode JSON or binary outputs (timed: the gate
counts decode and encode as the loop time a request costs).
A request's deadline is its arrival (when the app is called with it, `_StampArrival`) plus
the smaller of `timeout_ms` and its own `parameters.timeout` (Triton's, in microseconds). It is
checked before the body is read, once it is decoded and when its slot comes: a request past it
is answered 504 and never runs (counted REJECTED, as Triton counts a request that timed out in
its scheduler); one that passes it while waiting or running is cancelled (a running one
counted CANCELED).

When the app's lifespan starts, before it takes traffic, each model's gate is calibrated with
a representative request (calibration.py), so the deadline check predicts from the first
request on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncgraph.errors import ExecutorClosedError, InputValidationError, OverloadedError
from asyncgraph.runtime.executor import Executor
from asyncgraph.runtime.weights import weights_ran_on
from asyncgraph.serve import metrics as m
from asyncgraph.serve.admission import Admission, Ticket, capacity_for
from asyncgraph.serve.calibration import calibrate as calibrate_model
from asyncgraph.serve.codec import (
    DEFAULT_MAX_JSON_BYTES,
    HEADER,
    InferRequest,
    decode_request,
    encode_response,
    response_bytes,
)
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.serve.names import check_name, check_version
from asyncgraph.serve.repository_http import NOT_ALLOWED, repository_routes

logger = logging.getLogger("asyncgraph.serve")

T = TypeVar("T")

#: Bodies larger than this are decoded and encoded on a thread, so the loop keeps serving.
OFFLOAD_BYTES = 1 << 20

#: Compressed bodies inflate inline up to this many bytes (~0.2 ms), the rest on a thread.
INLINE_INFLATE_BYTES = 64 << 10

#: Seconds a client should wait before retrying a 503 (the Retry-After header): an overloaded
#: queue drains in about that long at the rates the server reaches, and clients that honour
#: it (tritonclient's retries, most HTTP libraries' backoff) spread their retries.
RETRY_AFTER_S = 1

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


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


class ExecutionTimeout(Exception):
    """The request passed its deadline: before it ran (`ran` False: it never executed) or
    while it ran (its execution was cancelled)."""

    def __init__(self, message: str, *, ran: bool) -> None:
        super().__init__(message)
        self.ran = ran


#: The ASGI scope key holding the loop time a request reached the app (`_StampArrival`): its
#: deadline counts from there, so the body's read and everything before the route runs count.
ARRIVAL_KEY = "asyncgraph.arrival"


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a request must be answered (loop time), its timeout and where the timeout came
    from, for the 504's message."""

    at: float
    timeout_s: float
    source: str

    def remaining(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def passed(self) -> bool:
        return self.remaining() <= 0

    def describe(self) -> str:
        """`0.2 ms timeout (parameters.timeout = 200 us)`: the unit a client sent too."""
        text = f"{self.timeout_s * 1e3:g} ms timeout ({self.source}"
        if self.source == "parameters.timeout":
            text += f" = {round(self.timeout_s * 1e6)} us"
        return text + ")"

    def exceeded(self, model: str, phase: str, ran: bool, queue_s: float | None = None) -> (
        ExecutionTimeout
    ):
        """The 504 of a request that passed this deadline while in `phase`."""
        since = asyncio.get_running_loop().time() - (self.at - self.timeout_s)
        queued = "" if queue_s is None else f", queued {queue_s * 1e3:.1f} ms"
        return ExecutionTimeout(
            f"model {model!r}: the request exceeded the {self.describe()} while {phase} "
            f"({since * 1e3:.1f} ms after it reached the server{queued}); "
            + ("its execution was cancelled" if ran else "it never ran"),
            ran=ran,
        )


def deadline_for(
    arrival: float, server_s: float | None, request_s: float | None
) -> Deadline | None:
    """The earlier of the server's timeout and the request's own, from its arrival."""
    if request_s is not None and (server_s is None or request_s < server_s):
        return Deadline(arrival + request_s, request_s, "parameters.timeout")
    if server_s is not None:
        return Deadline(arrival + server_s, server_s, "--timeout-ms")
    return None


@dataclass(slots=True)
class _Served:
    executor: Executor
    interface: ModelInterface
    admission: Admission
    version: str | None = None  # a repository's version (model_control.py); None: the app's
    # the version each weights version of the Executor serves as, shared by the _Served of
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
    (`_Served.label` of the weights it ran on)."""

    outputs: list[Any]
    queue_s: float
    compute_s: float
    version: str | None


class ModelControlHooks(Protocol):
    """What the server asks of model control (model_control.ModelControl)."""

    def served(self, name: str, version: str | None = None) -> _Served: ...
    def versions(self, name: str) -> list[str]: ...
    def not_loaded(self, name: str) -> bool: ...
    def index(self, ready: bool = False) -> list[dict[str, str]]: ...
    async def load(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...
    async def unload(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...


class InferenceServer:
    """The state behind the routes: models, their queues, limits and metrics."""

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
        self._served: dict[str, _Served] = {}
        self.metrics = m.ServerMetrics(models, self._admission, version)
        for name in list(models):
            try:
                check_name(name)
            except ProtocolError as exc:  # no request could name it
                raise ValueError(f"models: {exc.message}") from None
            self.served(name)  # a model that cannot be served fails here, not per request

    # -- models -----------------------------------------------------------------------------

    def served(self, name: str, version: str | None = None) -> _Served:
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
            served = _Served(
                ex,
                ModelInterface(name, ex.graph),
                Admission(
                    name, capacity_for(ex.config), self.max_queue, self.max_queue_bytes,
                    first_burst=ex.config.max_concurrent_executions,
                ),
            )
            self._served[name] = served
        return served

    def lookup(self, route: str, name: str, version: str | None = None) -> _Served:
        """`served`, for a client's request on `route` (infer, metadata): its refusal, a
        malformed name or version (400) or one not served (404), counted in the metrics."""
        try:
            return self.served(name, version)
        except ProtocolError as exc:
            self.metrics.unserved(route, exc.status)
            raise

    def readiness(self, name: str, version: str | None = None) -> bool:
        """Whether model `name` (at `version`) is ready to serve: False for a repository
        model with no version loaded; refused (400, 404) and counted as `lookup` is."""
        try:
            self._check(name, version)
            if self.control is not None and self.control.not_loaded(name):
                return False
            self.served(name, version)
        except ProtocolError as exc:
            self.metrics.unserved("ready", exc.status)
            raise
        return self.model_ready(name)

    def _check(self, name: str, version: str | None) -> None:
        """A 400 for a name or version no model can have. The app's own `version` is taken
        as it was given (it is the one version a plain app serves, whatever its form)."""
        check_name(name)
        if self.control is not None or version != self.version:
            check_version(version)

    def _check_counted(self, route: str, name: str) -> None:
        try:
            check_name(name)
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
        self._check_counted("load", name)
        await self.control.load(name, parameters)

    async def unload_model(
        self, name: str, parameters: Mapping[str, Any] | None = None
    ) -> None:
        if self.control is None:
            raise ProtocolError(NOT_ALLOWED, 503)
        self._check_counted("unload", name)
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
                    "its slots hold them", name, _describe(exc) if str(exc) else
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

    # -- inference --------------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        # the deadline counts from when the request reached the app (its headers), stamped by
        # _StampArrival; a route called without it (a test calling the handler) counts from now
        arrival = request.scope.get(ARRIVAL_KEY) or loop.time()
        name = request.path_params["name"]
        # nothing awaited from this lookup to admission.enter: model control closes a replaced
        # version once its gate is empty (model_control.py)
        served = self.lookup("infer", name, request.path_params.get("version"))
        timing: list[float] = []
        response, failure = await self._infer(request, served, arrival, timing)
        self.metrics.observe(
            name, response.status_code, total_s=loop.time() - arrival, timing=timing,
            failure=failure,
        )
        return response

    async def _infer(
        self, request: Request, served: _Served, arrival: float, timing: list[float]
    ) -> tuple[Response, str | None]:
        """The response and Triton's failure reason (None on success) of one request."""
        name = served.interface.model
        try:
            declared = self._declared_length(request)
            server_deadline = deadline_for(arrival, self.timeout_s, None)
            if server_deadline is not None and server_deadline.passed():
                raise server_deadline.exceeded(name, "it waited to be read", ran=False)
            # refused (503) before the body is read if it cannot make the server's deadline
            # or the queue's memory caps are reached
            # the body's bytes are charged as they arrive (Ticket.grow), not as declared
            with served.admission.enter(
                0, server_deadline.remaining() if server_deadline else None,
                expected_bytes=declared or 0,
            ) as ticket:
                body = await self._read_body(request, ticket, declared)
                async with served.admission.decoding(ticket):  # one decode per loop turn
                    decoded = await _maybe_offload(
                        len(body), decode_request, body, request.headers.get(HEADER),
                        served.interface, self.max_json_bytes,
                    )
                deadline = deadline_for(arrival, self.timeout_s, decoded.timeout_s)
                del body  # freed while it queues; the ticket keeps its size as the estimate
                if deadline is not None and deadline.passed():  # not worth running any more
                    raise deadline.exceeded(name, "it was read and decoded", ran=False)
                ran = await self.execute(request, served, decoded, ticket, deadline)
            timing += [ran.queue_s, ran.compute_s]
            size = self.response_size(name, decoded, ran.outputs)
            with served.admission.encoding():
                payload, headers = await _maybe_offload(
                    size, encode_response, name, decoded, ran.outputs, ran.version or self.version,
                )
            return Response(payload, 200, headers=headers), None
        except (ClientDisconnected, ClientDisconnect):
            return Response(status_code=499), m.CANCELED  # nobody reads it; it is for the log
        except Exception as exc:
            error, failure = request_failure(name, exc)
            response = error_response(error)
            if error.status == 408:  # the rest of the body may still come: do not read it
                response.headers["connection"] = "close"
            return response, failure

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

    def _declared_length(self, request: Request) -> int | None:
        """The Content-Length header, checked against the size limit (413)."""
        declared = request.headers.get("content-length")
        if declared is None:
            return None
        try:
            size = int(declared)
        except ValueError:
            raise ProtocolError(
                f"Content-Length header: expected an integer, got {declared!r}"
            ) from None
        if size > self.max_request_bytes:
            raise _too_large(size, self.max_request_bytes)
        return size

    async def _read_body(self, request: Request, ticket: Ticket, declared: int | None) -> bytes:
        """The body, within the size limit (413) and `body_timeout_s` (408), its bytes
        charged to the ticket as they arrive (503 past --max-queue-bytes), then inflated."""
        limit = self.max_request_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(size, limit)
                    ticket.grow(len(chunk))
                    chunks.append(chunk)
        except TimeoutError:
            of = "" if declared is None else f" of {declared}"
            raise ProtocolError(
                f"request body: {size}{of} bytes arrived in {self.body_timeout_s:g} s, the "
                f"limit for a body (--body-timeout-s)", 408,
            ) from None
        body = b"".join(chunks)
        del chunks
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            body = await _decompress(body, encoding, limit)
            ticket.resize(len(body))
        elif encoding != "identity":
            raise ProtocolError(
                f"Content-Encoding header: unsupported {encoding!r}; expected gzip or deflate",
                status=415,
            )
        return body

    async def execute(
        self,
        request: Request | None,
        served: _Served,
        decoded: InferRequest,
        ticket: Ticket,
        deadline: Deadline | None,
    ) -> Ran:
        """Queue, execute and time one request; cancelled at its deadline or a disconnect.

        A request whose deadline passes while it queues, or has passed when it is handed its
        slot, is answered 504 without running. Without an HTTP `request` (gRPC: the RPC's task
        is cancelled when its client goes away) nothing watches for a disconnect."""
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
                return Ran(outputs, queue_s, time.perf_counter() - started,
                           served.label(weights_ran_on()))  # in the task that executed

        async def bounded() -> Ran:
            if deadline is None:
                return await run()
            try:
                async with asyncio.timeout_at(deadline.at):
                    return await run()
            except TimeoutError:
                raise deadline.exceeded(
                    model, "running" if running else "queued", ran=running, queue_s=queue_s
                ) from None

        if request is None:
            return await bounded()
        return await _until_disconnect(bounded(), request.receive)


# -- the app --------------------------------------------------------------------------------


def create_app(
    models: Mapping[str, Executor],
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_queue_bytes: int | None = None,
    timeout_ms: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    close_executors: bool = False,
    version: str = "1",
    calibrate: bool = True,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> Starlette:
    """A Starlette app serving `models` (name -> Executor) over the Open Inference Protocol.

    Args:
        models: the models by name; read on every request, so a dict filled later works.
        max_queue: requests that may wait per model beyond the free execution slots; more
            get 503 (a hard cap for memory; the deadline usually refuses long before).
        max_queue_bytes: request body bytes that may wait per model; more get 503. None:
            `QUEUE_BYTES_PER_MAX_REQUEST` x `max_request_bytes`.
        timeout_ms: each request's deadline after its arrival: one that cannot make it is
            refused (503) when it arrives, one past it is cancelled (queued or running) and
            answered 504. A request's own `parameters.timeout` (microseconds) may shorten it.
        max_request_bytes: larger request bodies get 413, before or while they are read.
        close_executors: close every executor when the app's lifespan ends (the app owns
            them, as under `asyncgraph serve`).
        version: the single model version the app reports and accepts in URLs.
        calibrate: time a representative request of each model when the app's lifespan
            starts, so admission predicts waits from the first request (calibration.py).
            A mounted app's lifespan does not run: call `app.state.asyncgraph.calibrate()`
            from the parent's lifespan for the same.
        max_json_bytes: JSON parsed whole per request (the document outside its data
            arrays, and any data array that is not a flat or evenly nested array of values)
            may be at most this long; more gets 413 (codec.py: `json.loads` holds the GIL).
        max_response_bytes: a response estimated larger (codec.response_bytes) gets 400.
        body_timeout_s: a request body must arrive within this many seconds of its headers;
            a slower one gets 408 and its connection is closed.
    """
    server = InferenceServer(
        models, max_queue=max_queue, max_queue_bytes=max_queue_bytes, timeout_ms=timeout_ms,
        max_request_bytes=max_request_bytes, version=version, max_json_bytes=max_json_bytes,
        max_response_bytes=max_response_bytes, body_timeout_s=body_timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if calibrate:
            await server.calibrate()
        try:
            yield
        finally:
            server.shutting_down = True
            if close_executors:
                for ex in list(models.values()):
                    await ex.aclose()

    routes = _routes(server)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_StampArrival)
    # a trailing slash is a 404 in the protocol's format, not a 307 to the path without it
    app.router.redirect_slashes = False
    app.add_exception_handler(ProtocolError, _protocol_error_handler)
    app.add_exception_handler(HTTPException, _http_error_handler)
    app.state.asyncgraph = server
    return app


def _routes(server: InferenceServer) -> list[Route]:
    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        ok = not server.shutting_down and all(
            server.model_ready(n) for n in list(server.models)
        )
        status = 200 if ok else 503
        return JSONResponse({"ready": ok}, status, headers=_retry_after(status))

    async def server_metadata(request: Request) -> Response:
        from asyncgraph import __version__

        extensions = ["binary_tensor_data"]
        if server.control is not None:
            extensions.append("model_repository")
        return JSONResponse(
            {"name": "asyncgraph", "version": __version__, "extensions": extensions}
        )

    async def model_metadata(request: Request) -> Response:
        name = request.path_params["name"]
        served = server.lookup("metadata", name, request.path_params.get("version"))
        return JSONResponse({
            "name": name,
            "versions": server.versions(name),
            "platform": "asyncgraph",
            **served.interface.metadata(),
        })

    async def model_ready(request: Request) -> Response:
        name = request.path_params["name"]
        ok = server.readiness(name, request.path_params.get("version"))
        status = 200 if ok else 503
        return JSONResponse({"name": name, "ready": ok}, status, headers=_retry_after(status))

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=m.CONTENT_TYPE)

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    return [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route(model, model_metadata, methods=["GET"]),
        Route(versioned, model_metadata, methods=["GET"]),
        Route(model + "/ready", model_ready, methods=["GET"]),
        Route(versioned + "/ready", model_ready, methods=["GET"]),
        Route(model + "/infer", server.infer, methods=["POST"]),
        Route(versioned + "/infer", server.infer, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        # Triton's model repository extension
        *repository_routes(server.repository_index, server.load_model, server.unload_model),
    ]


def request_failure(model: str, exc: Exception) -> tuple[ProtocolError, str]:
    """A failed inference request's error, with the HTTP status it is answered with, and
    Triton's failure reason it is counted under: what every transport answers (HTTP here,
    gRPC in grpc_server.py maps the status to a gRPC code)."""
    if isinstance(exc, ProtocolError):
        return exc, m.REJECTED if exc.status == 503 else m.OTHER
    if isinstance(exc, InputValidationError):
        return ProtocolError(f"model {model!r}: {exc}"), m.OTHER
    if isinstance(exc, (ExecutorClosedError, OverloadedError)):
        return ProtocolError(f"model {model!r}: {exc}", 503), m.REJECTED
    if isinstance(exc, ExecutionTimeout):
        # Triton counts a request that timed out in its scheduler (before it ran) as
        # REJECTED; a running execution cancelled at its deadline is CANCELED
        return ProtocolError(str(exc), 504), m.CANCELED if exc.ran else m.REJECTED
    logger.error("model %r: inference failed", model, exc_info=exc)
    return ProtocolError(f"model {model!r}: {_describe(exc)}", 500), m.BACKEND


def error_response(exc: ProtocolError) -> Response:
    """The protocol's error body, `{"error": "..."}`, with the error's status."""
    return JSONResponse(exc.body(), exc.status, headers=_retry_after(exc.status))


def _retry_after(status: int) -> dict[str, str] | None:
    """A 503 (overloaded, closed, not ready) tells the client when to come back."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


async def _protocol_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProtocolError)
    return error_response(exc)


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in the protocol's error format too."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse({"error": message}, exc.status_code, headers=exc.headers)


class _StampArrival:
    """Stamps each HTTP request's scope with the loop time it reached the app (`ARRIVAL_KEY`)
    before Starlette's middleware and routing run: the earliest point an ASGI app sees a
    request, once the server has parsed its headers. Its deadline counts from there. A parent
    app that stamped it first (mounting this one) keeps its own stamp."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ARRIVAL_KEY not in scope:
            scope[ARRIVAL_KEY] = asyncio.get_running_loop().time()
        await self.app(scope, receive, send)


# -- helpers --------------------------------------------------------------------------------


async def _until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`; cancel it and raise ClientDisconnected if the client goes away first.

    The body has been read, so the next ASGI message is `http.disconnect`, sent by the server
    when the connection closes (or once the response is complete, which cannot happen here).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        # wait for both even if we are cancelled meanwhile: the frame must be back first
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise ClientDisconnected()


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _maybe_offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Inflate a compressed body, refusing one that inflates past the size limit.

    A body that inflates to at most INLINE_INFLATE_BYTES inflates on the loop; a larger one
    starts over on a thread: the compressed size says nothing of the inflated one, and 64 MB
    take ~190 ms to inflate. Starting over wastes the inline part (~0.2 ms), where carrying on
    would join the two parts: a copy of the whole body, holding the GIL (~27 ms for 60 MB).
    """
    wbits = 31 if encoding == "gzip" else 15
    inflater = zlib.decompressobj(wbits=wbits)
    cap = min(limit + 1, INLINE_INFLATE_BYTES)
    out = _inflate(inflater, body, cap, encoding)
    if len(out) == cap <= limit:  # stopped at the cap: there may be more
        inflater = zlib.decompressobj(wbits=wbits)
        out = await asyncio.to_thread(_inflate, inflater, body, limit + 1, encoding)
    if len(out) > limit or inflater.unconsumed_tail:
        raise ProtocolError(
            f"request body: inflates past the limit of {limit} bytes (--max-request-bytes)", 413
        )
    if not inflater.eof:
        raise ProtocolError(f"request body: truncated {encoding} data")
    return out


def _inflate(inflater: Any, data: bytes, max_length: int, encoding: str) -> bytes:
    try:
        out: bytes = inflater.decompress(data, max_length)
    except zlib.error as exc:
        raise ProtocolError(f"request body: bad {encoding} data ({exc})") from None
    return out


def _too_large(size: int, limit: int) -> ProtocolError:
    return ProtocolError(
        f"request body: {size} bytes exceeds the limit of {limit} bytes (--max-request-bytes)",
        status=413,
    )


def _describe(exc: BaseException) -> str:
    """An execution error in one line, with the node that raised it."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    notes = [n.splitlines()[0] for n in getattr(exc, "__notes__", [])]
    return " ".join([text, *(f"({n})" for n in notes[:1])])
