"""Protocol helpers shared by the handlers: request validation with pytrio's models, wire tensors, pages."""

from __future__ import annotations

import math

import numpy as np

from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError, EventFailure
from trl_grpo_ext.pytrio_server.images import VisionInput

WORKSPACE = "ws_local"
USER = "user_local"
ACTOR_CUID = "actor_local"


def wire_tensor(array: np.ndarray) -> dict:
    data = np.ascontiguousarray(array, dtype="<f4")
    return {"dtype": "<f4", "shape": list(data.shape), "encoding": "raw_le", "data": data.tobytes()}


def validation_message(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        parts = []
        for item in errors(include_url=False, include_input=False):
            loc = ".".join(str(p) for p in item["loc"])
            parts.append(f"{loc}: {item['msg']}" if loc else item["msg"])
        return "; ".join(parts)
    return str(error)


def validate(model, data: object, code: str, status: int = 400):
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ApiError(status, code, validation_message(error)) from None


def prompt_input(model_input, engine, event: bool = False) -> tuple[list[int], VisionInput | None]:
    """The token ids of a pytrio ``ModelInput`` and, when it holds image chunks, its `VisionInput` (its tokens then
    hold each image's placeholders): a 400 (`event`: a failed event) for an image the served model cannot take."""
    chunks = model_input.chunks
    if all(getattr(chunk, "type", "") == "encoded_text" for chunk in chunks):
        return [t for chunk in chunks for t in chunk.tokens], None
    try:
        vision = engine.vision_input(chunks)
    except EngineError as error:
        if event:
            raise EventFailure(error.code, error.message) from None
        raise ApiError(400, error.code, error.message) from None
    return vision.tokens, vision


def page(items: list, query: dict, key: str) -> dict:
    offset, limit = query_int(query, "offset", 0), query_int(query, "limit", 100)
    return {key: items[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total": len(items)}}


def query_int(query: dict, key: str, default: int) -> int:
    """A non-negative integer query parameter; 400 when it is not one."""
    value = (query.get(key) or [str(default)])[0]
    if not value.isdigit():
        raise ApiError(400, "invalid_query", f"query parameter {key} must be a non-negative integer, got {value!r}")
    return int(value)


def non_finite_path(value: object, path: str = "") -> str | None:
    """Where `value` (decoded JSON or msgpack) holds a NaN or infinite number (``"a.b[3]"``), or None.

    No request field of the protocol takes one (learning rates, weights, advantages, sampling parameters, TTLs):
    a NaN that got through would fail later, far from the request, or poison a run's weights.
    """
    if isinstance(value, float):
        return None if math.isfinite(value) else path or "(body)"
    if isinstance(value, dict):
        for key, item in value.items():
            found = non_finite_path(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        try:  # fast path for the long number lists of forward data: fsum is exact, finite iff every item is
            if math.isfinite(math.fsum(value)):
                return None
        except (TypeError, OverflowError, ValueError):
            pass
        for i, item in enumerate(value):
            found = non_finite_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def require_finite(value: object, code: str) -> None:
    """400 `code` naming the first NaN or infinite number in a request body."""
    where = non_finite_path(value)
    if where is not None:
        raise ApiError(400, code, f"{where} is not a finite number; every number of a request must be finite")


def item_lengths(payload: object) -> list[int] | None:
    """Token count of each datum of a raw ``trainer.forward(_backward)`` payload (an image chunk counts its
    ``expected_tokens``, checked against the image later); None when it is not shaped like one (its validation then
    says what is wrong)."""
    try:
        return [sum(_chunk_length(chunk) for chunk in datum["model_input"]["chunks"]) for datum in payload["data"]]
    except (TypeError, KeyError, ValueError):
        return None


def _chunk_length(chunk: dict) -> int:
    if chunk.get("type") == "image":
        return int(chunk.get("expected_tokens") or 0)
    return len(chunk["tokens"])
