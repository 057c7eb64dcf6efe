"""The one thing asyncgraph adds to Serve's HTTP proxy: a lost replica answers 503, not 500.

When a replica dies (killed, out of memory, its node gone) with requests in flight, Serve's
proxy gets `ActorDiedError` for each; Serve retries only requests not yet sent to a replica, so
these end with no response from the proxy's app, and uvicorn answers `500 Internal Server
Error` in plain text: a client cannot tell it from a kernel error and should not retry it. An
inference is idempotent, so the right answer is the one `asyncgraph serve` gives when it cannot
serve a request now: 503 with `Retry-After: 1` and the protocol's `{"error": ...}` body.

`ReplicaLostMiddleware` wraps the proxy's app and sends exactly that when the app returns
without having sent a response. The replica's messages reach the proxy in batches, so a replica
can die after its `http.response.start` was forwarded and before its body was: the client then
got headers (a Content-Length) and a closed connection, which no HTTP client reads as "retry".
The middleware therefore holds the start of each response until its body is complete (or until
a streamed body begins, after which a cut cannot be undone) and answers 503 in its place when
the body never came. Responses that finish pass through untouched (a kernel error stays a 500,
Serve's own 503/408 stay as they are). It is installed with Serve's proxy callback, an
environment variable the proxy reads when it starts:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=asyncgraph.ray.proxy:proxy_middlewares

`asyncgraph serve --ray` sets it for the local Ray instance it starts; on a cluster it must be
in the environment of `ray start` on every node that runs a proxy (docs/scale-out.md).

A retry inside the proxy was the alternative; it is not done because a request that kills its
replica (out of memory) would then kill the next replica too, and the next. The client decides.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The environment variable Serve's proxy reads for a callback returning middlewares.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
#: Its value for asyncgraph.
PROXY_CALLBACK = "asyncgraph.ray.proxy:proxy_middlewares"

#: The header that marks a 503 from this middleware (for logs and tests).
REPLICA_LOST_HEADER = "x-asyncgraph-replica-lost"

RETRY_AFTER_S = 1


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback: the middlewares for the proxy's HTTP app."""
    return [Middleware(ReplicaLostMiddleware)]


class ReplicaLostMiddleware:
    """Answer 503 + Retry-After where the proxy's app ended an HTTP request with no whole response.

    A response's start is held until the app's next message (its body, whole in the usual
    inference answer, or a streamed body's first chunk), so "never started" and "started,
    body lost" both become a 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.replica_lost = 0  # 503s sent (statistics)
        self.body_lost = 0  # of those, responses whose start was held and whose body never came

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # the response's start, until its body comes
        answered = False  # the start and a message after it went out

        async def holding_send(message: Message) -> None:
            nonlocal held, answered
            if message["type"] == "http.response.start":
                held = message
                return
            if held is not None:  # the body's first message (or an extension's send)
                start, held = held, None
                await send(start)
                answered = True
            await send(message)

        await self.app(scope, receive, holding_send)
        if not answered:
            self.replica_lost += 1
            self.body_lost += held is not None
            await _send_replica_lost(scope, send)

    def statistics(self) -> dict[str, int]:
        return {"replica_lost": self.replica_lost, "body_lost": self.body_lost}


async def _send_replica_lost(scope: Scope, send: Send) -> None:
    path = scope.get("path", "")
    body = json.dumps({
        "error": f"{scope.get('method', 'GET')} {path}: the replica serving this request "
                 f"stopped before it answered (Serve restarts it); retry"
    }).encode()
    await send({
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (REPLICA_LOST_HEADER.encode(), b"1"),
        ],
    })
    await send({"type": "http.response.body", "body": body})
