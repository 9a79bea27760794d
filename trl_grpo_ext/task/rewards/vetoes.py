"""Hard vetoes for the hybrid reward: conditions under which a completion scores `veto_value` no matter
what else it does right. Each veto is `f(text, *, completion_ids, max_completion_length, eos_token_ids)
-> bool` (True = vetoed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from trl_grpo_ext.task.answers import boxes_disagree, extract_all_boxed

VETOES: dict[str, Callable[..., bool]] = {}


def _veto(name):
    def decorator(func):
        VETOES[name] = func
        return func

    return decorator


@_veto("no_box")
def no_box(text: str, **_) -> bool:
    """No closed `\\boxed{}` answer."""
    return not extract_all_boxed(text)


@_veto("conflicting_boxes")
def conflicting_boxes(text: str, **_) -> bool:
    """Boxes that state different answers (`\\boxed{17} ... \\boxed{18}`)."""
    return boxes_disagree(extract_all_boxed(text))


REPETITION_TAIL_CHARS = 8_000
REPETITION_NGRAM = 10
REPETITION_MAX_COUNT = 4
REPETITION_MAX_PERIOD = 200
REPETITION_MIN_SPAN = 64


def has_repetition_loop(
    text: str,
    tail_chars: int = REPETITION_TAIL_CHARS,
    ngram: int = REPETITION_NGRAM,
    max_count: int = REPETITION_MAX_COUNT,
) -> bool:
    """A degenerate loop in the last `tail_chars` characters: either the text ends in one chunk of up to
    200 characters repeated at least 4 times (and over at least 64 characters: `!!!!...`, `Let me check.
    Let me check. ...`), or some run of `ngram` words occurs `max_count` times or more. Linear time."""
    tail = text[-tail_chars:].rstrip()
    for period in range(1, REPETITION_MAX_PERIOD + 1):
        span = max(4 * period, REPETITION_MIN_SPAN)
        if span > len(tail):
            break
        window = tail[-span:]
        if window[period:] == window[:-period]:
            return True
    words = tail.split()
    if len(words) < ngram * max_count:
        return False
    counts = Counter(tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1))
    return max(counts.values()) >= max_count


@_veto("repetition")
def repetition(text: str, **_) -> bool:
    """A repetition loop (see `has_repetition_loop`)."""
    return has_repetition_loop(text)


def _ids_list(ids) -> list | None:
    if ids is None:
        return None
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    try:
        return list(ids)
    except TypeError:
        return None


@_veto("truncated")
def truncated(text: str, completion_ids=None, max_completion_length=None, eos_token_ids=None, **_) -> bool:
    """The completion was cut off by the generation limit.

    With TRL's `completion_ids` (which include the EOS token when generation stopped on it) and
    `max_completion_length`: length >= the limit and the last token is not an EOS. With only
    `eos_token_ids`: the last token is not an EOS (TRL's own `mask_truncated_completions` test). With
    neither, truncation cannot be told from text and this veto never fires (`no_box` usually does)."""
    ids = _ids_list(completion_ids)
    if not ids:
        return False
    eos = set(eos_token_ids) if eos_token_ids is not None else None
    ends_with_eos = eos is not None and ids[-1] in eos
    if max_completion_length:
        return len(ids) >= int(max_completion_length) and not ends_with_eos
    if eos is not None:
        return not ends_with_eos
    return False


DEFAULT_VETOES = ("no_box", "conflicting_boxes", "repetition", "truncated")
