"""Per-batch plumbing shared by the reward functions: TRL's columns, per-item safety, warnings."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)


def column(values, n: int, name: str) -> list:
    """A per-completion column from TRL's kwargs; a single value is broadcast to all completions."""
    if values is None:
        return [None] * n
    if isinstance(values, (str, bytes, int, float)) or not hasattr(values, "__len__"):
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"`{name}` has {len(values)} values for {n} completions")
    return values


def as_list(completions) -> list:
    if completions is None:
        return []
    if isinstance(completions, (str, dict)):
        return [completions]
    return list(completions)


def safe_score(func, *args, default=0.0, **kwargs):
    """`func(*args)`, or `default` if it raises: one bad completion must not stop a training step."""
    try:
        return func(*args, **kwargs)
    except Exception:
        logger.warning("reward failed on one completion; scoring it %s", default, exc_info=True)
        return default


def warn_once_per_call(message: str):
    warnings.warn(message, RuntimeWarning, stacklevel=3)
