"""A request's deadline, the same over every transport (HTTP in app.py, gRPC in grpc_server.py).

A request's deadline is its arrival plus the smaller of the server's `--timeout-ms` and its own
`parameters.timeout` (Triton's, in microseconds; gRPC adds the client's own deadline). A
transport checks it before the body is read, once it is decoded, and the core
(`InferenceServer.execute`, core.py) when its slot comes: a request past it is answered 504
and never runs (counted REJECTED, as Triton counts a request that timed out in its
scheduler); one that passes it while waiting or running is cancelled (a running one counted
CANCELED). `ExecutionTimeout.ran` tells the two apart (failures.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class ExecutionTimeout(Exception):
    """The request passed its deadline: before it ran (`ran` False: it never executed) or
    while it ran (its execution was cancelled)."""

    def __init__(self, message: str, *, ran: bool) -> None:
        super().__init__(message)
        self.ran = ran


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
