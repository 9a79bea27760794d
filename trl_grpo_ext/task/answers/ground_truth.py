"""Ground-truth answers: GSM8K's `#### N`, a boxed solution (MATH style) or a bare value."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

from trl_grpo_ext.task.answers.boxes import extract_boxed
from trl_grpo_ext.task.answers.normalise import normalize_answer

# Words a math answer may hold outside LaTeX commands (`sin(x)`, `log 2`); any other word of two or
# more letters makes an unboxed ground truth prose.
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "pi", "inf", "infty", "mod", "gcd", "lcm"}
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


def is_prose(answer: str) -> bool:
    """Whether a normalised answer holds words (`Natalia sold 24 clips`, `twelve`) rather than a value.
    A unit after a number was already dropped by normalisation (`24 clips` -> `24`)."""
    return any(w.lower() not in _MATH_WORDS for w in _WORD.findall(_LATEX_COMMAND.sub(" ", answer)))


def parse_ground_truth(value) -> str | None:
    """Normalised ground-truth answer, or None when it cannot be parsed.

    Accepts GSM8K's `answer` column (solution text ending in `#### N`), a solution containing a
    `\\boxed{}` answer (MATH style; a boxed answer may be words), a bare value (`"1,080"`,
    `"\\frac{1}{2}"`) or an int/float. An unboxed answer that is prose (`"The answer is twelve"`,
    `"#### Natalia sold 24 clips"`) cannot be parsed: matching it as a string would reward copying."""
    try:
        if isinstance(value, str):
            return _parse_ground_truth_text(value)
        if value is None or isinstance(value, bool):
            return None
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            return normalize_answer(repr(value)) if math.isfinite(value) else None
        if isinstance(value, Fraction):
            return normalize_answer(f"{value.numerator}/{value.denominator}") if value.denominator != 1 else str(value)
        return None
    except Exception:
        return None


@lru_cache(maxsize=65_536)
def _parse_ground_truth_text(value: str) -> str | None:
    text = value.strip()
    if not text:
        return None
    boxed = False
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        answer = tail.splitlines()[0] if tail else ""
    elif "\\boxed" in text or "\\fbox" in text:
        answer, boxed = extract_boxed(text) or "", True
    elif len(text) > 200 or "\n" in text:
        return None  # prose without a marked final answer
    else:
        answer = text
    answer = normalize_answer(answer)
    if not answer or (not boxed and is_prose(answer)):
        return None
    return answer
