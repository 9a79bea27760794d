"""Whether two answers are the same, decided by input complexity and never by the clock.

1. Normalised text equal -> equal.
2. Both sides exact numbers (`values.exact_value`) -> compared exactly; a side past a size limit
   (`values.Refused`) -> not equal. This covers what GSM8K-style answers use, with no sympy. A prediction
   that is arithmetic left to do (`1 - 8`, `3 \\times 6`; `values.is_unevaluated_arithmetic`) is not
   equal to a numeric truth: it restates the question instead of answering it.
3. Plain-text rules: a hedged answer (`17 or 18`) against a single truth, words against words, a
   number against words or against an expression in free variables -> decided here.
4. What is left (symbols: `\\pi`, `x^2+1`, sets, unlike roots) goes to math-verify in a worker process
   (`verifier`) if it is small enough (`symbolic_within_limits`), else not equal.

Steps 1-3 are pure functions of the two strings. Step 4 runs math-verify without its own timeouts and
waits up to FALLBACK_TIMEOUT_S, a safety net far above what any input within the limits needs (tens
of milliseconds), so a loaded machine gives the same verdicts as an idle one.
"""

from __future__ import annotations

import logging
import os
import re
from functools import lru_cache

from trl_grpo_ext.task.answers.arithmetic import Refused
from trl_grpo_ext.task.answers.normalise import MAX_ANSWER_CHARS, is_hedged, normalize_answer
from trl_grpo_ext.task.answers.text import completion_text
from trl_grpo_ext.task.answers.values import exact_value, is_unevaluated_arithmetic, values_equal

logger = logging.getLogger(__name__)

# Seconds math-verify may take on one comparison before it counts as not equal (and its worker is
# replaced, so a late answer can never reach another call). Inputs within the symbolic limits below
# take well under a second even on a loaded 2-core machine.
FALLBACK_TIMEOUT_S = float(os.environ.get("TRL_GRPO_EXT_VERIFY_TIMEOUT", "10"))

# Limits for what may go to math-verify; past them a comparison is not equal without asking.
MAX_SYMBOLIC_CHARS = 200
MAX_SYMBOLIC_EXPONENT = 32  # each integer exponent (sympy expands (x+1)^99 for seconds)
MAX_SYMBOLIC_EXPONENT_SUM = 64  # all integer exponents together
MAX_SYMBOLIC_DIGITS = 30  # digits in one number
MAX_SYMBOLIC_DEPTH = 10  # nesting of braces and parentheses

_NON_MATH = re.compile(r"[A-Za-z ]+")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_VARIABLE = re.compile(r"[A-DF-HJ-Za-df-hj-z]")  # any Latin letter but the constants e and i
_EXPONENT = re.compile(r"\^\s*\{?\s*[+-]?(\d+)")
_NESTED_EXPONENT = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^")
_FACTORIAL = re.compile(r"(\d*)\s*!")
_DIGITS = re.compile(r"\d+")
_BIG_OPERATORS = re.compile(r"\\(?:underbrace|overbrace|sum|prod|int|lim|binom|choose)(?![A-Za-z])")


def symbolic_within_limits(s: str) -> bool:
    """Whether a normalised answer is small enough for math-verify (see the MAX_SYMBOLIC_* limits): no
    exponent towers, no factorial but of a literal up to 100, no sums/products/integrals/limits."""
    if len(s) > MAX_SYMBOLIC_CHARS or _NESTED_EXPONENT.search(s) or _BIG_OPERATORS.search(s):
        return False
    exponents = [int(e) for e in _EXPONENT.findall(s)]
    if any(e > MAX_SYMBOLIC_EXPONENT for e in exponents) or sum(exponents) > MAX_SYMBOLIC_EXPONENT_SUM:
        return False
    if any(not n or int(n) > 100 for n in _FACTORIAL.findall(s)):
        return False
    if any(len(n) > MAX_SYMBOLIC_DIGITS for n in _DIGITS.findall(s)):
        return False
    depth = deepest = 0
    for c in s:
        if c in "{(":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "})":
            depth -= 1
    return deepest <= MAX_SYMBOLIC_DEPTH


def _exact(s: str):
    """(value or None, refused)."""
    try:
        return exact_value(s), False
    except Refused:
        return None, True


@lru_cache(maxsize=65_536)
def decide(p: str, t: str) -> bool | None:
    """True/False when the answers' text decides, None when only math-verify can (normalised inputs)."""
    if not p or not t:
        return False
    if p == t:
        return True
    if not is_hedged(t) and is_hedged(p):
        return False
    (vp, refused_p), (vt, refused_t) = _exact(p), _exact(t)
    if refused_p or refused_t:
        return False
    if vp is not None and vt is not None:
        if is_unevaluated_arithmetic(p) and not is_unevaluated_arithmetic(t):
            return False  # `1 - 8` against `-7`: the question's arithmetic, not its value
        return values_equal(p, vp, t, vt)
    if _NON_MATH.fullmatch(p) and _NON_MATH.fullmatch(t):
        return p.strip().lower() == t.strip().lower()  # words (`yes`, `B`): compare as words
    if vt is not None and not any(c.isdigit() for c in p) and "\\" not in p:
        return False  # a number against words: nothing for math-verify to find
    if vt is not None and _VARIABLE.search(_LATEX_COMMAND.sub(" ", p)):
        return False  # an expression in free variables (or prose) is not a number
    if not symbolic_within_limits(p) or not symbolic_within_limits(t):
        return False
    return None


def same_answer(a, b) -> bool:
    """Quick equality of two answers by normalisation and exact value (no math-verify). Used to decide
    whether several boxes in one completion state the same answer."""
    pa, pb = normalize_answer(a), normalize_answer(b)
    if pa == pb:
        return True
    (va, refused_a), (vb, refused_b) = _exact(pa), _exact(pb)
    if refused_a or refused_b or va is None or vb is None:
        return False
    return values_equal(pa, va, pb, vb)


def answers_match(pred, truth, timeout: float | None = None) -> bool:
    """Whether `pred` states the same answer as `truth`, mathematically; the same verdict on every
    machine, under any load, in any thread and process, whatever was compared before.

    Decided without sympy for numeric answers (see the module docstring). What needs math-verify waits
    up to `timeout` seconds (default FALLBACK_TIMEOUT_S) for it; only input that slow counts as not equal
    for lack of time, and such input is outside the stated limits."""
    try:
        p, t = completion_text(pred).strip(), completion_text(truth).strip()
        if not p or not t:
            return False
        if len(p) > MAX_ANSWER_CHARS or len(t) > MAX_ANSWER_CHARS:
            return normalize_answer(p) == normalize_answer(t)
        np_, nt = normalize_answer(p), normalize_answer(t)
        verdict = decide(np_, nt)
        if verdict is not None:
            return verdict
        from trl_grpo_ext.task.answers.verifier import (
            VERIFIER,  # on first use: most scoring never needs its process pool
        )

        return VERIFIER.check(np_, nt, FALLBACK_TIMEOUT_S if timeout is None else timeout) is True
    except Exception:
        logger.debug("answers_match failed", exc_info=True)
        return False


def warm_up_verifier() -> bool:
    """Start the math-verify worker now (a few seconds), so the first symbolic comparison inside a
    training step does not pay for it. Optional: the first comparison that needs it starts it anyway."""
    from trl_grpo_ext.task.answers.verifier import VERIFIER  # on first use, as in `answers_match`

    return VERIFIER.warm_up()
