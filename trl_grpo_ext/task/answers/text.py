"""Completion -> text, for every form TRL produces."""

from __future__ import annotations


def completion_text(completion) -> str:
    """Text of a completion in any form TRL produces: a string, a list of message dicts (conversational;
    assistant messages are joined), one message dict, or content parts (`[{"type": "text", "text": ...}]`).
    Anything else (None, numbers, objects) gives a string or "" and never raises."""
    try:
        return _completion_text(completion)
    except Exception:  # a reward must score bad input, not crash the training step
        return ""


def _completion_text(completion) -> str:
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, bytes):
        return completion.decode("utf-8", errors="replace")
    if isinstance(completion, dict):
        if "content" in completion:
            return _content_text(completion["content"])
        if "text" in completion:
            return _content_text(completion["text"])
        return ""
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or messages
        if chosen:
            return "\n".join(t for t in (_completion_text(m) for m in chosen) if t)
        return "".join(p for p in completion if isinstance(p, str))
    if isinstance(completion, (int, float)) and not isinstance(completion, bool):
        return str(completion)
    return ""


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal content parts
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return _completion_text(content) if isinstance(content, (bytes, int, float)) else ""
