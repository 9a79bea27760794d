"""Answer parsing shared by every reward and by evaluation.

Modules: `text` (completion -> text), `boxes` (`\\boxed{}` spans and contents, whether boxes disagree),
`normalise` (one spelling per answer), `values` (exact values of numeric answers, with stated size
limits), `equality` (`answers_match`: text, exact values, then math-verify), `ground_truth`
(`#### N`, boxed solutions, bare values), `verifier` (the math-verify worker process).

Grading is deterministic: the same (prediction, truth) gets the same verdict under any machine load, in
any thread or process and whatever was compared before; see `equality` for how.
"""

from __future__ import annotations

import sys

from trl_grpo_ext.task.answers import equality, ground_truth, normalise, values
from trl_grpo_ext.task.answers.arithmetic import Refused, Surd
from trl_grpo_ext.task.answers.boxes import (
    MAX_BOX_CHARS,
    MAX_SCAN_CHARS,
    BoxSpan,
    box_contents,
    box_spans,
    boxes_disagree,
    extract_all_boxed,
    extract_boxed,
)
from trl_grpo_ext.task.answers.equality import (
    FALLBACK_TIMEOUT_S,
    answers_match,
    decide,
    same_answer,
    symbolic_within_limits,
    warm_up_verifier,
)
from trl_grpo_ext.task.answers.ground_truth import is_prose, parse_ground_truth
from trl_grpo_ext.task.answers.normalise import MAX_ANSWER_CHARS, extract_last_number, is_hedged, normalize_answer
from trl_grpo_ext.task.answers.text import completion_text
from trl_grpo_ext.task.answers.values import exact_value, values_equal

__all__ = [
    "FALLBACK_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "MAX_BOX_CHARS",
    "MAX_SCAN_CHARS",
    "BoxSpan",
    "Refused",
    "Surd",
    "answers_match",
    "box_contents",
    "box_spans",
    "boxes_disagree",
    "clear_caches",
    "completion_text",
    "decide",
    "exact_value",
    "extract_all_boxed",
    "extract_boxed",
    "extract_last_number",
    "is_hedged",
    "is_prose",
    "normalize_answer",
    "parse_ground_truth",
    "same_answer",
    "symbolic_within_limits",
    "values_equal",
    "warm_up_verifier",
]


def clear_caches() -> None:
    """Forget memoised results (for benchmarks that time cold scoring). Results never depend on them."""
    for cached in (equality.decide, normalise._normalize_cached, ground_truth._parse_ground_truth_text):
        cached.cache_clear()
    values._exact_value_cached.cache_clear()
    verifier = sys.modules.get(f"{__name__}.verifier")
    if verifier is not None:
        verifier.VERIFIER._results.clear()
