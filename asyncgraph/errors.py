"""The exceptions asyncgraph raises, each naming the thing that is wrong.

Kernel errors are *not* wrapped: the caller gets the kernel's own exception type with
its attributes, and a PEP 678 note naming the node, its target and the user's source line.
"""

from __future__ import annotations


class AsyncGraphError(Exception):
    """Base class of every error asyncgraph raises on its own account."""


class GraphValidationError(AsyncGraphError, ValueError):
    """The graph is malformed: a cycle, a dangling value, a duplicate name, an unknown op."""


class UnsupportedOpsError(AsyncGraphError, NotImplementedError):
    """One or more ops of the graph have no kernel; all of them are listed at load time."""

    def __init__(self, message: str, ops: list[str]) -> None:
        super().__init__(message)
        self.ops = ops


class InputValidationError(AsyncGraphError, ValueError):
    """An input does not match the program's signature (structure, dtype, device, shape)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ProgramLoadError(AsyncGraphError, ValueError):
    """A program file could not be loaded (not a .pt2, truncated, inconsistent, unsafe)."""


class BatchingError(AsyncGraphError, ValueError):
    """Batching was asked for a program whose signature cannot batch along dim 0."""


class ExecutorClosedError(AsyncGraphError, RuntimeError):
    """The executor was closed with aclose(); it takes no new executions."""


class BatchCancelledError(AsyncGraphError, RuntimeError):
    """The batch a request ran in was cancelled by the runtime, not by the request's caller.

    Raised on trio only (asyncio cancels the caller's future: CancelledError); a batch
    cancelled by aclose(cancel=True) gives ExecutorClosedError instead.
    """


class WeightsError(AsyncGraphError, ValueError):
    """A weight swap names an unknown weight or a tensor of the wrong shape or dtype."""


class OverloadedError(AsyncGraphError, RuntimeError):
    """A bounded queue is full, so the call was refused instead of queued without limit.

    `bound` names the setting (say "ExecutorConfig.max_frame_waiters") and `limit` its value:
    raise the setting, or shed load before calling. A server answers 503 with Retry-After.
    """

    def __init__(self, message: str, bound: str, limit: int) -> None:
        super().__init__(message)
        self.bound = bound
        self.limit = limit
