"""The local server's three error types, one per way a refusal reaches the client.

- `ApiError`: an HTTP answer ``{"code", "message"}`` with its status (Control and actor requests).
- `EventFailure`: a training event that ends ``failed`` with that code and message (polled by the client).
- `EngineError`: the model side cannot serve a request; the handler turns it into one of the two above.
"""

from __future__ import annotations

import re

# An absolute path in an exception's text (not a URL's or a `trio://` URI's slashes, not a relative "a/b")
_PATH = re.compile(r"(?<![\w.:/])/[^\s'\"():,]+")


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


def without_paths(text: str) -> str:
    """`text` with every absolute path replaced by ``<path>``: what the server's disk looks like is no client's
    business (the log keeps the full text)."""
    return _PATH.sub("<path>", text)


def describe(error: BaseException) -> str:
    """One line on an unexpected exception for an error answer: its type and text, without the file names an
    `OSError` carries or any other absolute path."""
    if isinstance(error, OSError):
        return f"{type(error).__name__}: {error.strerror or 'error'}"
    text = (str(error).strip().splitlines() or [""])[0]
    return without_paths(f"{type(error).__name__}: {text}")[:500]
