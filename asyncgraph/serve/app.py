"""create_app: a Starlette app that serves Executors over the Open Inference Protocol (KServe v2).

    app = create_app({"mlp": executor}, timeout_ms=1000)

The HTTP transport over the server's core (core.py's InferenceServer, `app.state.asyncgraph`):
the routes, the request's body (its size limits, Content-Encoding, its read timeout), the JSON
and binary codec (codec.py), the arrival stamp a deadline counts from, noticing a client that
goes away, and the protocol's error bodies. Lookups, admission, deadlines (deadlines.py),
execution, failures' statuses (failures.py) and metrics are the core's, shared with gRPC
(grpc_server.py).

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
A request's deadline (deadlines.py) counts from its arrival: when the app is called with it
(`_StampArrival`), so the body's read and everything before the route runs count.

When the app's lifespan starts, before it takes traffic, each model's gate is calibrated with
a representative request (calibration.py), so the deadline check predicts from the first
request on.
"""

from __future__ import annotations

import asyncio
import gc
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncgraph.runtime.executor import Executor
from asyncgraph.serve import metrics as m
from asyncgraph.serve.admission import Ticket
from asyncgraph.serve.codec import (
    DEFAULT_MAX_JSON_BYTES,
    HEADER,
    decode_request,
    encode_response,
)
from asyncgraph.serve.core import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    InferenceServer,
    Served,
    maybe_offload,
)
from asyncgraph.serve.deadlines import deadline_for
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.extensions import served_extensions
from asyncgraph.serve.failures import RETRY_AFTER_S, request_failure
from asyncgraph.serve.model_config import config_routes
from asyncgraph.serve.repository_http import repository_routes
from asyncgraph.serve.triton_http import shared_memory_routes, statistics_routes

T = TypeVar("T")

#: Compressed bodies inflate inline up to this many bytes (~0.2 ms), the rest on a thread.
INLINE_INFLATE_BYTES = 64 << 10


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


#: The ASGI scope key holding the loop time a request reached the app (`_StampArrival`): its
#: deadline counts from there, so the body's read and everything before the route runs count.
ARRIVAL_KEY = "asyncgraph.arrival"


class HttpInference:
    """The infer route (`POST .../infer`): one HTTP request's path over the InferenceServer
    (core.py): read the body, decode it, execute it through the server and encode the
    answer. What is HTTP's alone lives here: the arrival stamp, Content-Length and
    Content-Encoding, the body's read limits, the JSON and binary codec (codec.py) and
    noticing a client that goes away."""

    def __init__(self, server: InferenceServer) -> None:
        self.server = server

    async def infer(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        # the deadline counts from when the request reached the app (its headers), stamped by
        # _StampArrival; a route called without it (a test calling the handler) counts from now
        arrival = request.scope.get(ARRIVAL_KEY) or loop.time()
        name = request.path_params["name"]
        # nothing awaited from this lookup to admission.enter: model control closes a replaced
        # version once its gate is empty (model_control.py)
        served = self.server.lookup("infer", name, request.path_params.get("version"))
        timing: list[float] = []
        response, failure = await self._infer(request, served, arrival, timing)
        self.server.metrics.observe(
            name, response.status_code, total_s=loop.time() - arrival, timing=timing,
            failure=failure, version=served.version,
        )
        return response

    async def _infer(
        self, request: Request, served: Served, arrival: float, timing: list[float]
    ) -> tuple[Response, str | None]:
        """The response and Triton's failure reason (None on success) of one request."""
        server = self.server
        name = served.interface.model
        # the shared memory regions it names, held from its decode until its answer is made
        regions = server.shared_memory.lease(server.max_request_bytes)
        try:
            declared = self._declared_length(request)
            server_deadline = deadline_for(arrival, server.timeout_s, None)
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
                    decode_started = time.perf_counter()
                    decoded = await maybe_offload(
                        len(body), decode_request, body, request.headers.get(HEADER),
                        served.interface, server.max_json_bytes, regions,
                    )
                    decode_s = time.perf_counter() - decode_started
                deadline = deadline_for(arrival, server.timeout_s, decoded.timeout_s)
                del body  # freed while it queues; the ticket keeps its size as the estimate
                if deadline is not None and deadline.passed():  # not worth running any more
                    raise deadline.exceeded(name, "it was read and decoded", ran=False)
                ran = await _until_disconnect(
                    server.execute(served, decoded, ticket, deadline), request.receive
                )
            timing += [ran.queue_s, ran.compute_s, decode_s]  # metrics.observe's order
            size = server.response_size(name, decoded, ran.outputs)
            with served.admission.encoding():
                encode_started = time.perf_counter()
                payload, headers = await maybe_offload(
                    size, encode_response, name, decoded, ran.outputs,
                    ran.version or server.version,
                )
                timing.append(time.perf_counter() - encode_started)
            return Response(payload, 200, headers=headers), None
        except (ClientDisconnected, ClientDisconnect):
            return Response(status_code=499), m.CANCELED  # nobody reads it; it is for the log
        except Exception as exc:
            error, failure = request_failure(name, exc)
            response = error_response(error)
            if error.status == 408:  # the rest of the body may still come: do not read it
                response.headers["connection"] = "close"
            return response, failure
        finally:
            regions.release()

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
        if size > self.server.max_request_bytes:
            raise _too_large(size, self.server.max_request_bytes)
        return size

    async def _read_body(self, request: Request, ticket: Ticket, declared: int | None) -> bytes:
        """The body, within the size limit (413) and `body_timeout_s` (408), its bytes
        charged to the ticket as they arrive (503 past --max-queue-bytes), then inflated."""
        limit = self.server.max_request_bytes
        timeout_s = self.server.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(size, limit)
                    ticket.grow(len(chunk))
                    chunks.append(chunk)
        except TimeoutError:
            of = "" if declared is None else f" of {declared}"
            raise ProtocolError(
                f"request body: {size}{of} bytes arrived in {timeout_s:g} s, the "
                f"limit for a body (--body-timeout-s)", 408,
            ) from None
        body = b"".join(chunks)
        del chunks
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            body = await decompress(body, encoding, limit)
            ticket.resize(len(body))
        elif encoding != "identity":
            raise ProtocolError(
                f"Content-Encoding header: unsupported {encoding!r}; expected gzip or deflate",
                status=415,
            )
        return body


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
    freeze_heap: bool = False,
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
            `QUEUE_BYTES_PER_MAX_REQUEST` (core.py) x `max_request_bytes`.
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
        freeze_heap: once the lifespan has calibrated, before traffic, collect and freeze
            the heap (`gc.freeze`): the collector's full passes then walk only what serving
            made, not torch's and the models' objects (such a pass took 90-220 ms with torch
            and transformers loaded, a stall of every request in flight). For an app that
            owns its process, as under `asyncgraph serve`: the heap is the process's.
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
        if freeze_heap:
            _freeze_heap()
        try:
            yield
        finally:
            server.shutting_down = True
            server.shared_memory.close()  # unmap the regions no request uses
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


def _freeze_heap() -> None:
    """Move what is alive after start-up to the collector's permanent generation (see
    `app`'s freeze_heap): loaded models, torch, the imports. Objects made later are
    collected as usual."""
    gc.collect()
    gc.freeze()


def _routes(server: InferenceServer) -> list[Route]:
    infer = HttpInference(server).infer

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

        return JSONResponse(
            {"name": "asyncgraph", "version": __version__, "extensions": served_extensions()}
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
        # Triton's statistics extension, before `model`: /v2/models/stats is not a model
        *statistics_routes(server),
        Route(model, model_metadata, methods=["GET"]),
        Route(versioned, model_metadata, methods=["GET"]),
        Route(model + "/ready", model_ready, methods=["GET"]),
        Route(versioned + "/ready", model_ready, methods=["GET"]),
        Route(model + "/infer", infer, methods=["POST"]),
        Route(versioned + "/infer", infer, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        # Triton's model configuration extension (model_config.py)
        *config_routes(server),
        # Triton's model repository extension
        *repository_routes(server.repository_index, server.load_model, server.unload_model),
        # Triton's system (and refused CUDA) shared memory extensions (triton_http.py)
        *shared_memory_routes(server),
    ]


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


async def decompress(body: bytes, encoding: str, limit: int) -> bytes:
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
