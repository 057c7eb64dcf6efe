"""A failed request's answer, the same over every transport: its HTTP status and message, and
Triton's failure reason it is counted under (metrics.py).

`request_failure` maps what a request failed with to a ProtocolError: the protocol's own
refusals as they are (503 counted REJECTED, the rest OTHER), a bad input 400, a closed or
overloaded Executor 503, a passed deadline 504 (REJECTED if it never ran, CANCELED if its
execution was cancelled), anything else 500 (BACKEND), logged with its traceback. HTTP
(app.py) answers with the status; gRPC (grpc_server.py) maps it to a gRPC code. A 503 tells
the client to come back in `RETRY_AFTER_S` seconds over both.
"""

from __future__ import annotations

import logging

from asyncgraph.errors import ExecutorClosedError, InputValidationError, OverloadedError
from asyncgraph.serve import metrics as m
from asyncgraph.serve.deadlines import ExecutionTimeout
from asyncgraph.serve.errors import ProtocolError

logger = logging.getLogger("asyncgraph.serve")

#: Seconds a client should wait before retrying a 503 (the Retry-After header): an overloaded
#: queue drains in about that long at the rates the server reaches, and clients that honour
#: it (tritonclient's retries, most HTTP libraries' backoff) spread their retries.
RETRY_AFTER_S = 1


def request_failure(model: str, exc: Exception) -> tuple[ProtocolError, str]:
    """A failed inference request's error, with the HTTP status it is answered with, and
    Triton's failure reason it is counted under: what every transport answers (HTTP in
    app.py, gRPC in grpc_server.py maps the status to a gRPC code)."""
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
    return ProtocolError(f"model {model!r}: {describe(exc)}", 500), m.BACKEND


def describe(exc: BaseException) -> str:
    """An execution error in one line, with the node that raised it."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    notes = [n.splitlines()[0] for n in getattr(exc, "__notes__", [])]
    return " ".join([text, *(f"({n})" for n in notes[:1])])
