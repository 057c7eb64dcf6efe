"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), beside HTTP.

    app = create_app({"mlp": executor}, close_executors=True)
    add_grpc(app, "127.0.0.1", 8001)  # `asyncgraph serve mlp.pt2 --grpc-port 8001`
    run(app, port=8000)

A grpcio asyncio server (`grpc.aio`) on the same event loop as the HTTP app and the
Executors, started by the app's lifespan once it has started (calibrated) and stopped when it
ends. It serves the app's `InferenceServer`: the same models, admission gates, deadlines,
metrics and error messages; only the transport differs. One request goes the way an HTTP one
does (app.py): the gate refuses it at once (UNAVAILABLE, `retry-after` in the trailing
metadata) if it cannot make its deadline -> decode in the gate's decode lane, checked against
the signature by codec.py's shared code (grpc_codec.py; INVALID_ARGUMENT) -> wait for a slot ->
execute, cancelled at its deadline (DEADLINE_EXCEEDED) or when the client cancels or goes away
(grpc cancels the RPC's task; the execution is cancelled with it) -> encode.

A request's deadline is the earliest of `--timeout-ms`, its `parameters.timeout` (Triton's,
microseconds) and the client's gRPC deadline (`context.time_remaining()`).

Errors map to gRPC status codes as Triton's do, from the HTTP status the same failure gets
(`STATUS_CODES`); both transports count a request once, in the same metrics, by that status.

ModelStreamInfer (Triton's bidirectional stream): each request is answered on the stream in the
order it came, up to `STREAM_WINDOW` of them running at once; a failed one is answered with its
`error_message` and the stream goes on.

On shutdown (SIGTERM, SIGINT) the gRPC server drains alongside HTTP: runner.py starts every
drain in `DRAINS_KEY` as uvicorn begins its own, so both stop taking new requests at once and
the ones in flight get `grace_s` to finish before they are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from starlette.applications import Starlette

from asyncgraph.serve import grpc_protocol as pb
from asyncgraph.serve import metrics as m
from asyncgraph.serve.app import (
    RETRY_AFTER_S,
    Deadline,
    InferenceServer,
    _maybe_offload,
    deadline_for,
    request_failure,
)
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.grpc_codec import decode_infer_request, encode_infer_response
from asyncgraph.serve.runner import DRAINS_KEY

logger = logging.getLogger("asyncgraph.serve")

#: The gRPC status of each HTTP status a failed request gets (as Triton maps them).
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

#: The trailing metadata key of an UNAVAILABLE answer: seconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after"

#: Requests of one ModelStreamInfer stream that may run at once (read ahead of the answers).
STREAM_WINDOW = 64

#: Bytes a response may have beyond --max-response-bytes (the protobuf framing).
_RESPONSE_SLACK = 1 << 16

#: HTTP status of a request whose client cancelled it (nginx's 499, as app.py counts it).
_CANCELLED = 499


def status_code(status: int) -> grpc.StatusCode:
    """The gRPC code of a failed request's HTTP status."""
    return STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)


class InferenceService:
    """The handlers of `inference.GRPCInferenceService` over an `InferenceServer`."""

    def __init__(self, server: InferenceServer) -> None:
        self.server = server

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
        control = self.server.control
        if control is not None and control.not_loaded(request.name):
            return pb.ModelReadyResponse(ready=False)  # in the repository, not loaded
        await self._served_or_abort(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.server.model_ready(request.name))

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from asyncgraph import __version__

        return pb.ServerMetadataResponse(name="asyncgraph", version=__version__)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = await self._served_or_abort(request.name, request.version, context)
        iface = served.interface
        return pb.ModelMetadataResponse(
            name=request.name, versions=self.server.versions(request.name),
            platform="asyncgraph",
            inputs=[i.metadata() for i in iface.inputs],
            outputs=[o.metadata() for o in iface.outputs],
        )

    async def _served_or_abort(
        self, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            return self.server.served(name, version or None)
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
        """Answer each request of the stream in order; up to STREAM_WINDOW run at once."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in requests:
                    await window.acquire()
                    task = asyncio.ensure_future(self.infer(request, context))
                    queue.put_nowait((request, task))
            finally:
                queue.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not None:
                request, task = item
                result = await task
                window.release()
                if isinstance(result, ProtocolError):
                    # with the request's model and id, so a client can tell which one failed
                    yield pb.ModelStreamInferResponse(
                        error_message=result.message,
                        infer_response=pb.ModelInferResponse(
                            model_name=request.model_name, model_version=request.model_version,
                            id=request.id,
                        ),
                    )
                else:
                    yield pb.ModelStreamInferResponse(infer_response=result)
            await reader  # the stream's own read error, if it had one
        finally:
            reader.cancel()
            left: list[asyncio.Future[Any]] = [reader]
            while not queue.empty():
                item = queue.get_nowait()
                if item is not None:
                    item[1].cancel()
                    left.append(item[1])
            # the executions must be cancelled and their frames back before the RPC ends
            await asyncio.gather(*left, return_exceptions=True)

    async def infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One ModelInferRequest: its ModelInferResponse, or the ProtocolError it failed
        with (HTTP status and message; counted in the metrics either way)."""
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        try:  # nothing awaited from here to admission.enter (see app.InferenceServer.infer)
            served = self.server.served(request.model_name, request.model_version or None)
        except ProtocolError as exc:
            return exc  # an unknown model: not counted, as over HTTP
        name = served.interface.model
        timing: list[float] = []
        try:
            result, failure = await self._infer(request, served, arrival, timing, context)
        except asyncio.CancelledError:  # the client cancelled, went away or ran out of time
            self.server.metrics.observe(  # no compute time: the execution did not finish
                name, _CANCELLED, total_s=loop.time() - arrival, timing=timing[:1],
                failure=m.CANCELED,
            )
            raise
        self.server.metrics.observe(
            name, 200 if failure is None else result.status, total_s=loop.time() - arrival,
            timing=timing, failure=failure,
        )
        return result

    async def _infer(
        self, request: Any, served: Any, arrival: float, timing: list[float],
        context: grpc.aio.ServicerContext,
    ) -> tuple[Any, str | None]:
        """app.InferenceServer._infer's path for a request grpc has already read and parsed."""
        server = self.server
        name = served.interface.model
        client = _client_deadline(arrival, context)
        try:
            first = _earliest(deadline_for(arrival, server.timeout_s, None), client)
            nbytes = request.ByteSize()
            with served.admission.enter(
                nbytes, first.remaining() if first is not None else None
            ) as ticket:
                async with served.admission.decoding(ticket):  # one decode per loop turn
                    decoded, raw = await _maybe_offload(
                        nbytes, decode_infer_request, request, served.interface
                    )
                deadline = _earliest(deadline_for(arrival, server.timeout_s, decoded.timeout_s),
                                     client)
                if deadline is not None and deadline.passed():
                    raise deadline.exceeded(name, "it was decoded", ran=False)
                outputs, queue_s, compute_s = await server.execute(
                    None, served, decoded, ticket, deadline
                )
            timing += [queue_s, compute_s]
            size = server.response_size(name, decoded, outputs)
            with served.admission.encoding():
                response = await _maybe_offload(
                    size, encode_infer_response, name, served.version or server.version,
                    decoded, outputs, raw,
                )
            return response, None
        except Exception as exc:
            return request_failure(name, exc)


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


async def _abort(context: grpc.aio.ServicerContext, error: ProtocolError) -> None:
    trailing = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),) if error.status == 503 else ()
    await context.abort(status_code(error.status), error.message, trailing_metadata=trailing)


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
        self, server: InferenceServer, host: str, port: int, *, grace_s: float = 10.0
    ) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.grace_s = grace_s
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
        grpc_server.add_generic_rpc_handlers((generic_handler(InferenceService(self.server)),))
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
    app: Starlette, host: str = "127.0.0.1", port: int = 8001, *, grace_s: float = 10.0
) -> GrpcEndpoint:
    """Serve `app`'s models (an app from create_app) over gRPC too, from its lifespan: the
    gRPC server starts once the app has started and stops when it ends, draining as the
    HTTP side does (runner.py starts the drain when uvicorn's shutdown begins)."""
    server: InferenceServer = app.state.asyncgraph
    endpoint = GrpcEndpoint(server, host, port, grace_s=grace_s)
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
