"""ProtocolError: a request the server refuses, with the HTTP status and the protocol's message.

The Open Inference Protocol answers every failure with `{"error": "<message>"}`; the message
names the field at fault (`inputs[0].shape[1]`), and says what was expected and what came.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A refused request: `status` is the HTTP status, `str(self)` the error message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, str]:
        return {"error": self.message}
