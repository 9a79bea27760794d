"""`format_reward`: does a completion state its answer the way the prompt asks?

Checks, in order (each one a named rule, reported by `format_checks`):

- `box`: at least one closed `\\boxed{...}` (or `\\fbox{...}`) in the answer section;
- `single_answer`: every box in the answer section states the same answer (`\\boxed{18}` twice is fine,
  `\\boxed{17} ... \\boxed{18}` is not);
- `clean_end`: after the last box only whitespace and punctuation (`.`, `$`, `\\]`, `**`, ...);
- `think` (only with `require_think=True`): one `</think>` with non-empty reasoning before it, at most one
  `<think>` and only before it; the answer section is the text after `</think>`. A completion that
  starts inside the reasoning (chat templates that put `<think>` in the prompt) passes.
"""

from __future__ import annotations

import re
import unicodedata

from trl_grpo_ext.task.answers import box_contents, box_spans, boxes_disagree, completion_text
from trl_grpo_ext.task.rewards._batch import as_list, safe_score
from trl_grpo_ext.task.rewards.registry import register_reward

_TAIL_WRAPPERS = re.compile(r"\\\]|\\\)|\\\$|\\\\|\*\*")
MAX_TAIL_CHARS = 200


def _is_clean_tail(tail: str) -> bool:
    if len(tail) > MAX_TAIL_CHARS:
        return False
    tail = _TAIL_WRAPPERS.sub("", tail)
    return all(c.isspace() or c == "$" or unicodedata.category(c).startswith("P") for c in tail)


def _think_split(text: str) -> tuple[bool, str]:
    """(think rule holds, answer section)."""
    if text.count("</think>") != 1:
        return False, text
    reasoning, answer = text.split("</think>", 1)
    opens = reasoning.count("<think>")
    if opens > 1 or "<think>" in answer:
        return False, answer
    if opens == 1:
        before, reasoning = reasoning.split("<think>", 1)
        if before.strip():
            return False, answer
    return bool(reasoning.strip()), answer


def format_checks(completion, require_think: bool = False) -> dict[str, bool]:
    """Each format rule -> whether the completion passes it (see the module docstring)."""
    text = completion_text(completion)
    checks: dict[str, bool] = {}
    if require_think:
        checks["think"], text = _think_split(text)
    spans = box_spans(text)
    checks["box"] = bool(spans)
    if spans:
        checks["single_answer"] = not boxes_disagree(box_contents(text, spans))
        checks["clean_end"] = _is_clean_tail(text[spans[-1].end : spans[-1].end + MAX_TAIL_CHARS + 1])
    else:
        checks["single_answer"] = checks["clean_end"] = False
    return checks


def make_format_reward(require_think: bool = False, partial_credit: bool = False, name: str | None = None):
    """A format reward. All rules pass -> 1.0, else 0.0; with `partial_credit`, the fraction of rules
    passed (`single_answer` and `clean_end` only count when there is a box)."""

    def score(completion) -> float:
        checks = format_checks(completion, require_think=require_think)
        if partial_credit:
            return sum(checks.values()) / len(checks)
        return 1.0 if all(checks.values()) else 0.0

    def reward(completions, **kwargs) -> list[float]:
        return [safe_score(score, c) for c in as_list(completions)]

    reward.__name__ = name or (
        "format_reward" + ("_think" if require_think else "") + ("_partial" if partial_credit else "")
    )
    reward.__qualname__ = reward.__name__
    reward.__doc__ = f"Format reward (require_think={require_think}, partial_credit={partial_credit})."
    reward.require_think = require_think
    reward.partial_credit = partial_credit
    return reward


format_reward = register_reward("format")(make_format_reward())
format_reward.__doc__ = (
    "1.0 when a completion ends with exactly one final boxed answer (repeats of the same answer allowed), "
    "followed by nothing but whitespace/punctuation, else 0.0."
)
register_reward("format_think")(make_format_reward(require_think=True))
register_reward("format_partial")(make_format_reward(partial_credit=True))
