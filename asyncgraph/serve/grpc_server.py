"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), beside HTTP.

    app = create_app({"mlp": executor}, close_executors=True)
    add_grpc(app, "127.0.0.1", 8001)  # `asyncgraph serve mlp.pt2 --grpc-port 8001`
    run(app, port=8000)

A grpcio asyncio server (`grpc.aio`) on the same event loop as the HTTP app and the
Executors, started by the app's lifespan once it has started (calibrated) and stopped when it
ends. It is a transport over the app's `InferenceServer` (core.py): the same models,
admission gates, deadlines (deadlines.py), metrics and error messages (failures.py); only the
transport differs. One request goes the way an HTTP one does (app.py): the gate refuses it at
once (UNAVAILABLE, `retry-after` in the trailing metadata) if it cannot make its deadline ->
decode in the gate's decode lane, checked against the signature by codec.py's shared code
(grpc_codec.py; INVALID_ARGUMENT) -> wait for a slot and execute (`InferenceServer.execute`),
cancelled at its deadline (DEADLINE_EXCEEDED) or when the client cancels or goes away (grpc
cancels the RPC's task; the execution is cancelled with it) -> encode.

A request's deadline is the earliest of `--timeout-ms`, its `parameters.timeout` (Triton's,
microseconds) and the client's gRPC deadline (`context.time_remaining()`).

Errors map to gRPC status codes as Triton's do, from the HTTP status the same failure gets
(`STATUS_CODES`); both transports count a request once, in the same metrics, by that status.

A model name or version no model can have is INVALID_ARGUMENT, one not served NOT_FOUND
(names.py; counted by route in asyncgraph_unserved_requests_total, as over HTTP). A typed
response is estimated at its encoded size (grpc_codec.response_bytes) against
--max-response-bytes, so it is refused (INVALID_ARGUMENT, counted) before it is built rather
than by grpc once it is.

ModelStreamInfer (Triton's bidirectional stream): each request is answered on the stream in the
order it came, up to `STREAM_WINDOW` of them running at once; a failed one is answered with its
`error_message` and the stream goes on, whatever it failed with (an error of the server's own
is logged once, with the model's name); every answer carries Triton's `triton_final_response`
(true: each request has one answer, as a non-decoupled Triton model's). Answers made and not
yet taken by grpc (the client has not read those before them) are bounded in bytes
(`HeldBytes`): per stream
(`STREAM_HELD_RESPONSES` x --max-response-bytes) and across the endpoint's streams
(`HELD_RESPONSES` x); an answer past either bound is dropped and its request answered
RESOURCE_EXHAUSTED (HTTP 429 in the metrics), and a stream at its bound reads no further
requests until its client reads (grpc's flow control then holds the client back).

On shutdown (SIGTERM, SIGINT) the gRPC server drains alongside HTTP: runner.py starts every
drain in `DRAINS_KEY` as uvicorn begins its own, so both stop taking new requests at once and
the ones in flight get `grace_s` to finish before they are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import grpc
from starlette.applications import Starlette

from asyncgraph.serve import grpc_protocol as pb
from asyncgraph.serve import metrics as m
from asyncgraph.serve.core import InferenceServer, maybe_offload
from asyncgraph.serve.deadlines import Deadline, deadline_for
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.extensions import served_extensions
from asyncgraph.serve.failures import RETRY_AFTER_S, describe, request_failure
from asyncgraph.serve.grpc_codec import (
    decode_infer_request,
    encode_infer_response,
    response_bytes,
)
from asyncgraph.serve.grpc_config import config_handler
from asyncgraph.serve.grpc_extensions import extensions_handler
from asyncgraph.serve.names import shown
from asyncgraph.serve.runner import DRAINS_KEY

logger = logging.getLogger("asyncgraph.serve")

#: The gRPC status of each HTTP status a failed request gets (as Triton maps them).
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

#: The parameter of a stream's answer that says it is its request's last (Triton's).
FINAL_RESPONSE = "triton_final_response"

#: The trailing metadata key of an UNAVAILABLE answer: seconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after"

#: Requests of one ModelStreamInfer stream that may run at once (read ahead of the answers).
STREAM_WINDOW = 64

#: A stream may hold this many times --max-response-bytes of answers its client has not read.
STREAM_HELD_RESPONSES = 4
#: All the streams of an endpoint together may hold this many times --max-response-bytes.
HELD_RESPONSES = 16

#: HTTP status of an answer dropped because its stream's client does not read (gRPC
#: RESOURCE_EXHAUSTED).
_NOT_READ = 429

#: Bytes a response may have beyond --max-response-bytes (the protobuf framing).
_RESPONSE_SLACK = 1 << 16

#: HTTP status of a request whose client cancelled it (nginx's 499, as app.py counts it).
_CANCELLED = 499


def status_code(status: int) -> grpc.StatusCode:
    """The gRPC code of a failed request's HTTP status."""
    return STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)


class HeldBytes:
    """A bound on the bytes of ModelStreamInfer answers made and not yet taken by grpc: one
    per stream, one across an endpoint's streams. grpc takes an answer once its client has
    read enough of those before it (HTTP/2 flow control); a client that sends and never reads
    would otherwise have up to STREAM_WINDOW answers of up to --max-response-bytes each held
    per stream, with nothing bounding them across streams.

    An answer that would pass `limit` is refused, except when nothing is held (every answer
    fits the bound alone: the stream goes on once its client reads). A refusal also closes
    the bound's `room` until an answer is released: a stream waits on its own before reading
    the next request."""

    def __init__(self, limit: int, where: str) -> None:
        if limit < 1:
            raise ValueError(f"the bound on answers held on {where} must be >= 1 byte, got "
                             f"{limit}")
        self.limit = limit
        self.where = where
        self.held = 0
        self.peak = 0  # the most held at once
        self._room = asyncio.Event()
        self._room.set()

    def check(self, model: str, size: int) -> None:
        """A 429 (RESOURCE_EXHAUSTED) if an answer of `size` bytes cannot be held too."""
        if self.held and self.held + size > self.limit:
            self._room.clear()
            raise ProtocolError(
                f"model {model!r}: the answer ({size} bytes) was dropped: {self.held} bytes of "
                f"answers on {self.where} wait for their client to read them, and it would "
                f"pass the limit of {self.limit} bytes; read a stream's answers as they come",
                _NOT_READ,
            )

    def add(self, size: int) -> None:
        self.held += size
        self.peak = max(self.peak, self.held)

    def remove(self, size: int) -> None:
        self.held -= size
        self._room.set()

    async def room(self) -> None:
        """Return once the last refusal's answers have started to drain."""
        await self._room.wait()


class _Reservation:
    """One stream request's answer, held in its bounds from when its size is known (before
    it is encoded) until grpc has taken it (or the stream has ended)."""

    def __init__(self, bounds: tuple[HeldBytes, ...]) -> None:
        self.bounds = bounds
        self.size = 0

    def take(self, model: str, size: int) -> None:
        """Hold `size` bytes in every bound, or in none (a 429 naming the bound passed)."""
        for bound in self.bounds:
            bound.check(model, size)
        for bound in self.bounds:
            bound.add(size)
        self.size = size

    def release(self) -> None:
        """Give the bytes back (once; again is a no-op)."""
        for bound in self.bounds:
            if self.size:
                bound.remove(self.size)
        self.size = 0


class InferenceService:
    """The handlers of `inference.GRPCInferenceService` over an `InferenceServer`.

    `stream_held_bytes` and `held_bytes` bound the answers a stream, and all streams, hold
    for clients that do not read them (HeldBytes; None: STREAM_HELD_RESPONSES and
    HELD_RESPONSES times --max-response-bytes)."""

    def __init__(
        self, server: InferenceServer, *, stream_held_bytes: int | None = None,
        held_bytes: int | None = None,
    ) -> None:
        self.server = server
        cap = server.max_response_bytes
        self.stream_held_bytes = (
            STREAM_HELD_RESPONSES * cap if stream_held_bytes is None else stream_held_bytes
        )
        HeldBytes(self.stream_held_bytes, "a stream")  # checked now, not at the first stream
        self.held = HeldBytes(HELD_RESPONSES * cap if held_bytes is None else held_bytes,
                              "all streams")

    # -- health and metadata ----------------------------------------------------------------

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        server = self.server
        ready = not server.shutting_down and all(
            server.model_ready(n) for n in list(server.models)
        )
        return pb.ServerReadyResponse(ready=ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:  # False for a repository model not loaded
            ready = self.server.readiness(request.name, request.version or None)
        except ProtocolError as exc:
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from asyncgraph import __version__

        return pb.ServerMetadataResponse(name="asyncgraph", version=__version__,
                                         extensions=served_extensions())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = await self._served_or_abort("metadata", request.name, request.version, context)
        iface = served.interface
        return pb.ModelMetadataResponse(
            name=request.name, versions=self.server.versions(request.name),
            platform="asyncgraph",
            inputs=[i.metadata() for i in iface.inputs],
            outputs=[o.metadata() for o in iface.outputs],
        )

    async def _served_or_abort(
        self, route: str, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            return self.server.lookup(route, name, version or None)
        except ProtocolError as exc:
            await _abort(context, exc)

    # -- the model repository extension (model_control.py) ---------------------------------

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        entries = self.server.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries]
        )

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self.server.load_model(request.model_name, _parameters(request))
        except ProtocolError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            await self.server.unload_model(request.model_name, _parameters(request))
        except ProtocolError as exc:
            await _abort(context, exc)
        return pb.RepositoryModelUnloadResponse()

    # -- inference --------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = await self.infer(request, context)
        if isinstance(result, ProtocolError):
            await _abort(context, result)
        return result

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Answer each request of the stream in order; up to STREAM_WINDOW run at once, and
        the answers not yet taken by grpc within the stream's and the endpoint's HeldBytes."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        held = HeldBytes(self.stream_held_bytes, "this stream")
        queue: asyncio.Queue[_Pending | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in requests:
                    await window.acquire()
                    await held.room()  # its client is not reading: read no more of it
                    reservation = _Reservation((held, self.held))
                    task = asyncio.ensure_future(self.infer(request, context, reservation))
                    queue.put_nowait((request, task, reservation))
            finally:
                queue.put_nowait(None)

        reader = asyncio.ensure_future(read())
        left: list[_Pending] = []
        try:
            while (item := await queue.get()) is not None:
                request, task, reservation = item
                try:
                    result = await task
                except Exception as exc:  # the server's own failure: this request's alone
                    result = _unexpected(request.model_name, exc)
                finally:
                    window.release()
                try:
                    yield _stream_answer(request, result)
                finally:
                    reservation.release()  # grpc has taken it (or the stream has ended)
            await reader  # the stream's own read error, if it had one
        finally:
            reader.cancel()
            while not queue.empty():
                if (item := queue.get_nowait()) is not None:
                    item[1].cancel()
                    left.append(item)
            # the executions must be cancelled and their frames back before the RPC ends
            await asyncio.gather(reader, *(p[1] for p in left), return_exceptions=True)
            for _request, _task, reservation in left:
                reservation.release()

    async def infer(
        self, request: Any, context: grpc.aio.ServicerContext,
        reservation: _Reservation | None = None,
    ) -> Any:
        """One ModelInferRequest: its ModelInferResponse, or the ProtocolError it failed
        with (HTTP status and message; counted in the metrics either way). A stream's
        request holds its answer's bytes in `reservation` once its size is known."""
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        try:  # nothing awaited from here to admission.enter (see app.HttpInference.infer)
            served = self.server.lookup(
                "infer", request.model_name, request.model_version or None
            )
        except ProtocolError as exc:
            return exc  # a malformed name or version, or not served: counted by route
        except Exception as exc:
            return _unexpected(request.model_name, exc)
        name = served.interface.model
        timing: list[float] = []
        try:
            result, failure = await self._infer(
                request, served, arrival, timing, context, reservation
            )
        except asyncio.CancelledError:  # the client cancelled, went away or ran out of time
            self.server.metrics.observe(  # no compute time: the execution did not finish
                name, _CANCELLED, total_s=loop.time() - arrival, timing=timing[:1],
                failure=m.CANCELED, version=served.version,
            )
            raise
        self.server.metrics.observe(
            name, 200 if failure is None else result.status, total_s=loop.time() - arrival,
            timing=timing, failure=failure, version=served.version,
        )
        return result

    async def _infer(
        self, request: Any, served: Any, arrival: float, timing: list[float],
        context: grpc.aio.ServicerContext, reservation: _Reservation | None,
    ) -> tuple[Any, str | None]:
        """app.HttpInference._infer's path for a request grpc has already read and parsed."""
        server = self.server
        name = served.interface.model
        client = _client_deadline(arrival, context)
        # the shared memory regions it names, held from its decode until its answer is made
        regions = server.shared_memory.lease(server.max_request_bytes)
        try:
            first = _earliest(deadline_for(arrival, server.timeout_s, None), client)
            nbytes = request.ByteSize()
            with served.admission.enter(
                nbytes, first.remaining() if first is not None else None
            ) as ticket:
                async with served.admission.decoding(ticket):  # one decode per loop turn
                    decode_started = time.perf_counter()
                    decoded, raw = await maybe_offload(
                        nbytes, decode_infer_request, request, served.interface, regions
                    )
                    decode_s = time.perf_counter() - decode_started
                deadline = _earliest(deadline_for(arrival, server.timeout_s, decoded.timeout_s),
                                     client)
                if deadline is not None and deadline.passed():
                    raise deadline.exceeded(name, "it was decoded", ran=False)
                ran = await server.execute(served, decoded, ticket, deadline)
            timing += [ran.queue_s, ran.compute_s, decode_s]  # metrics.observe's order
            outputs = ran.outputs
            size = server.response_size(
                name, decoded, outputs, response_bytes(decoded, outputs, raw)
            )
            if reservation is not None:
                reservation.take(name, size)
            with served.admission.encoding():
                encode_started = time.perf_counter()
                response = await maybe_offload(
                    size, encode_infer_response, name, ran.version or server.version,
                    decoded, outputs, raw,
                )
                timing.append(time.perf_counter() - encode_started)
            return response, None
        except Exception as exc:
            return request_failure(name, exc)
        finally:
            regions.release()


#: A stream's request, the task answering it and its answer's hold on the bounds.
_Pending = tuple[Any, "asyncio.Future[Any]", _Reservation]


def _stream_answer(request: Any, result: Any) -> Any:
    """A ModelStreamInferResponse: the response, or the error with the request's model and
    id, so a client can tell which request failed."""
    if not isinstance(result, ProtocolError):
        answer = pb.ModelStreamInferResponse(infer_response=result)
    else:
        answer = pb.ModelStreamInferResponse(
            error_message=result.message,
            infer_response=pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version,
                id=request.id,
            ),
        )
    # each request has this one answer: it is its final one (Triton's flag, which clients
    # that ask for `enable_empty_final_response` wait for; only a decoupled model, which
    # asyncgraph does not serve, would end a request with an empty answer of its own)
    answer.infer_response.parameters[FINAL_RESPONSE].bool_param = True
    return answer


def _unexpected(model: str, exc: Exception) -> ProtocolError:
    """A request's failure of the server's own (a bug): logged once, with its traceback and
    the model asked for, and answered 500 (INTERNAL) to that request alone."""
    logger.error("model %s: request failed", shown(model), exc_info=exc)
    return ProtocolError(f"model {shown(model)}: {describe(exc)}", 500)


def _parameters(request: Any) -> dict[str, Any]:
    """A repository request's parameters map as Python values."""
    out: dict[str, Any] = {}
    for key, value in request.parameters.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def _client_deadline(arrival: float, context: grpc.aio.ServicerContext) -> Deadline | None:
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return Deadline(arrival + remaining, remaining, "the client's gRPC deadline")


def _earliest(*deadlines: Deadline | None) -> Deadline | None:
    given = [d for d in deadlines if d is not None]
    return min(given, key=lambda d: d.at) if given else None


async def _abort(context: grpc.aio.ServicerContext, error: ProtocolError) -> NoReturn:
    trailing = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),) if error.status == 503 else ()
    await context.abort(status_code(error.status), error.message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


def generic_handler(service: InferenceService) -> grpc.GenericRpcHandler:
    """The service's methods as one grpc handler, with grpc_protocol's messages."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method, (request, response, client_streaming, server_streaming) in pb.METHODS.items():
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[client_streaming, server_streaming]
        handlers[method] = kind(
            getattr(service, method), request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(pb.SERVICE, handlers)


class GrpcEndpoint:
    """A grpc.aio server of an InferenceServer on host:port (0: a free one; `port` is the
    bound one once started)."""

    def __init__(
        self, server: InferenceServer, host: str, port: int, *, grace_s: float = 10.0,
        stream_held_bytes: int | None = None, held_bytes: int | None = None,
    ) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self.service = InferenceService(
            server, stream_held_bytes=stream_held_bytes, held_bytes=held_bytes
        )
        #: The answers all its streams hold for their clients (HeldBytes: held, peak, limit)
        self.held = self.service.held
        self._grpc: grpc.aio.Server | None = None
        self._stopping: asyncio.Future[None] | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> None:
        grpc_server = grpc.aio.server(options=[
            # never share a port with another server (grpc's default on Linux)
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.server.max_request_bytes),
            ("grpc.max_send_message_length", self.server.max_response_bytes + _RESPONSE_SLACK),
        ])
        grpc_server.add_generic_rpc_handlers((
            generic_handler(self.service),
            config_handler(self.server, _abort),  # ModelConfig (grpc_config.py)
            # statistics and shared memory (grpc_extensions.py)
            extensions_handler(self.server, _abort),
        ))
        try:
            self.port = grpc_server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"gRPC: cannot listen on {self.address} ({exc})") from None
        await grpc_server.start()
        self._grpc = grpc_server
        logger.info("gRPC (inference.GRPCInferenceService) on %s", self.address)

    async def stop(self) -> None:
        """Stop taking RPCs; those in flight get `grace_s` to finish, then are cancelled.
        Once: a second call waits for the first."""
        if self._grpc is None:
            return
        if self._stopping is None:
            self.server.shutting_down = True  # ServerReady and /v2/health/ready say so
            self._stopping = asyncio.ensure_future(self._grpc.stop(self.grace_s))
        await asyncio.shield(self._stopping)


def add_grpc(
    app: Starlette, host: str = "127.0.0.1", port: int = 8001, *, grace_s: float = 10.0,
    stream_held_bytes: int | None = None, held_bytes: int | None = None,
) -> GrpcEndpoint:
    """Serve `app`'s models (an app from create_app) over gRPC too, from its lifespan: the
    gRPC server starts once the app has started and stops when it ends, draining as the
    HTTP side does (runner.py starts the drain when uvicorn's shutdown begins).
    `stream_held_bytes`, `held_bytes`: the bounds on answers a stream, and all streams, hold
    for clients that do not read them (None: STREAM_HELD_RESPONSES and HELD_RESPONSES times
    --max-response-bytes)."""
    server: InferenceServer = app.state.asyncgraph
    endpoint = GrpcEndpoint(server, host, port, grace_s=grace_s,
                            stream_held_bytes=stream_held_bytes, held_bytes=held_bytes)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(parent: Starlette) -> AsyncIterator[Any]:
        async with inner(parent) as state:
            await endpoint.start()
            try:
                yield state
            finally:
                await endpoint.stop()

    app.router.lifespan_context = lifespan
    drains: list[Callable[[], Awaitable[None]]] = getattr(app.state, DRAINS_KEY, [])
    drains.append(endpoint.stop)
    setattr(app.state, DRAINS_KEY, drains)
    app.state.grpc = endpoint
    return endpoint
