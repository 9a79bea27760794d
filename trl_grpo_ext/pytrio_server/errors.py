"""The local server's three error types, one per way a refusal reaches the client.

- `ApiError`: an HTTP answer ``{"code", "message"}`` with its status (Control and actor requests).
- `EventFailure`: a training event that ends ``failed`` with that code and message (polled by the client).
- `EngineError`: the model side cannot serve a request; the handler turns it into one of the two above.
"""

from __future__ import annotations


class ApiError(Exception):
    """An HTTP error answer: ``{"code": ..., "message": ...}`` with `status`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class EventFailure(Exception):
    """Raised by an event handler: the event ends ``failed`` with this code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class EngineError(Exception):
    """A request the engine cannot serve; `code` is what the client sees as the error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message
