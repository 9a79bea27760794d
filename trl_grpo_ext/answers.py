"""Answer parsing shared by every reward and by evaluation: completion text, `\\boxed{}` extraction,
ground-truth parsing, normalisation and (time-bounded) mathematical equality.

Speed model: everything here is linear in the input and needs no sympy, except `answers_match`'s
fallback for answers plain normalisation cannot decide (`\\sqrt{8}` vs `2\\sqrt{2}`). That fallback runs
math-verify in a persistent worker process with a per-call deadline, so it is bounded in any thread
(math-verify's own timeout uses `signal.alarm`, which only works in the main thread) and a runaway
sympy computation can be killed without touching the caller.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from fractions import Fraction
from functools import lru_cache

logger = logging.getLogger(__name__)

__all__ = [
    "answers_match",
    "completion_text",
    "extract_all_boxed",
    "extract_boxed",
    "extract_last_number",
    "normalize_answer",
    "parse_ground_truth",
    "same_answer",
    "warm_up_verifier",
]

# Box search looks at the last MAX_SCAN_CHARS characters of a completion (a final answer sits at its
# end); if that region holds more than MAX_BRACE_TOKENS braces, only its last MAX_BRACE_TOKENS characters.
# Brace matching runs one Python step per brace, so this bounds it on adversarial input.
MAX_SCAN_CHARS = 100_000
MAX_BRACE_TOKENS = 4_000
# A box whose content is longer than this is not an answer (it is an unclosed box that a much later
# `}` happened to close); boxes inside it then count on their own.
MAX_BOX_CHARS = 2_000
# Answers longer than this are compared as text only; no real final answer is this long.
MAX_ANSWER_CHARS = 1_000
# Budget for one `answers_match` call that needs the math-verify fallback, in seconds.
FALLBACK_TIMEOUT_S = float(os.environ.get("TRL_GRPO_EXT_VERIFY_TIMEOUT", "0.025"))


# --------------------------------------------------------------------------------------------------
# completion -> text


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


# --------------------------------------------------------------------------------------------------
# \boxed{} extraction

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Escaped braces first so `\{` and `\}` (set notation) never count for grouping.
_BOX_TOKEN = re.compile(r"\\[{}]|\\(?:boxed|fbox)\s*\{|[{}]")


def _scan_region(text: str) -> str:
    region = text[-MAX_SCAN_CHARS:]
    if len(region) > MAX_BRACE_TOKENS and region.count("{") + region.count("}") > MAX_BRACE_TOKENS:
        return region[-MAX_BRACE_TOKENS:]
    return region


def _box_spans(text: str) -> list[tuple[int, int, int]]:
    """(box_start, content_start, content_end) of the top-level closed boxes of `text`, in order.

    One pass with a stack; between boxes the search jumps to the next `\\boxed{` at C speed. Unclosed
    boxes are dropped; a closed box nested in another closed box is not top-level."""
    closed: list[tuple[int, int, int]] = []
    pos = 0
    while True:
        m = _BOX_START.search(text, pos)
        if m is None:
            break
        # (box_start, content_start) for a box's brace, None for a plain brace
        stack: list[tuple[int, int] | None] = [(m.start(), m.end())]
        open_boxes = 1
        pos = len(text)
        for tok in _BOX_TOKEN.finditer(text, m.end()):
            g = tok.group()
            if g == "}":
                opened = stack.pop()
                if opened is not None:
                    open_boxes -= 1
                    if tok.start() - opened[1] <= MAX_BOX_CHARS:
                        closed.append((opened[0], opened[1], tok.start()))
                    if open_boxes == 0:
                        pos = tok.end()
                        break
            elif g == "{":
                stack.append(None)
            elif len(g) > 2:
                stack.append((tok.start(), tok.end()))
                open_boxes += 1
    if len(closed) < 2:
        return closed
    # Closed boxes are nested or disjoint; sorting by (start, -end) puts each parent before its children.
    closed.sort(key=lambda span: (span[0], -span[2]))
    top, reach = [], -1
    for span in closed:
        if span[0] >= reach:
            top.append(span)
            reach = span[2]
    return top


def extract_all_boxed(text) -> list[str]:
    """Contents of every top-level closed `\\boxed{...}` / `\\fbox{...}` in `text`, in order (stripped).
    Braces are balanced (`\\boxed{\\frac{1}{2}}`); an unclosed box is no answer."""
    text = completion_text(text)
    if "\\boxed" not in text and "\\fbox" not in text:
        return []
    region = _scan_region(text)
    return [region[s:e].strip() for _, s, e in _box_spans(region)]


def extract_boxed(text) -> str | None:
    """Content of the last top-level closed box in `text`, or None."""
    boxes = extract_all_boxed(text)
    return boxes[-1] if boxes else None


def last_box_span(text: str) -> tuple[int, int] | None:
    """(index of `\\boxed`, index after its closing brace) in `text` of the last top-level closed box."""
    region = _scan_region(text)
    spans = _box_spans(region)
    if not spans:
        return None
    offset = len(text) - len(region)
    start, _, end = spans[-1]
    return offset + start, offset + end + 1


# --------------------------------------------------------------------------------------------------
# last number (evaluation without a box)

_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_last_number(text) -> str | None:
    """The last number in `text` with thousands separators removed (`"... is 1,080."` -> `"1080"`), or None.
    Searches growing windows from the end, so long text costs no more than its tail."""
    text = completion_text(text)
    size = 256
    while True:
        start = max(0, len(text) - size)
        # Do not cut a number in half at the window edge.
        while start > 0 and (text[start - 1].isdigit() or text[start - 1] in ",.-"):
            start -= 1
        last = None
        for last in _LAST_NUMBER.finditer(text, start):  # noqa: B007 - only the last match is needed
            pass
        if last is not None:
            return _canonical_number(last.group().replace(",", ""))
        if start == 0:
            return None
        size *= 8


# --------------------------------------------------------------------------------------------------
# ground truth


def parse_ground_truth(value) -> str | None:
    """Normalised ground-truth answer, or None when it cannot be parsed.

    Accepts GSM8K's `answer` column (solution text ending in `#### N`), a solution containing a
    `\\boxed{}` answer (MATH style), a bare value (`"1,080"`, `"\\frac{1}{2}"`) or an int/float."""
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
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        answer = tail.splitlines()[0] if tail else ""
    elif "\\boxed" in text or "\\fbox" in text:
        answer = extract_boxed(text) or ""
    elif len(text) > 200 or "\n" in text:
        return None  # prose without a marked final answer
    else:
        answer = text
    answer = normalize_answer(answer)
    return answer or None


# --------------------------------------------------------------------------------------------------
# normalisation

_UNICODE = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\u2013": "-",
        "\u2014": "-",
        "\u2010": "-",
        "\u2011": "-",
        "\u00a0": " ",
        "\u2009": " ",
        "\u202f": " ",
        "\u00d7": "\\times ",
        "\u22c5": "\\cdot ",
        "\u00b7": "\\cdot ",
        "\u00f7": "/",
    }
)
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname|emph)\s*\{([^{}]*)\}"
)
_BOX_WRAPPER = re.compile(r"^\\(?:boxed|fbox)\s*\{(.*)\}$", re.DOTALL)
_LATEX_NOISE = re.compile(
    r"\\(?:left|right|displaystyle|textstyle|mathclap|limits|big|Big|bigg|Bigg)(?![a-zA-Z])"
    r"|\\[,!;:> ]|\\quad|\\qquad|~"
)
_MATH_DELIMS = re.compile(r"\\\(|\\\)|\\\[|\\\]|\\\$|\$")
_CURRENCY = re.compile(r"[£€¥₹]|\b(?:USD|EUR|GBP|Rs\.?)(?=\s*\d)")
_PERCENT = re.compile(r"\\?%|\\percent\b|\s*percent\b")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree\b")
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:(?:,|\{,\}|\s)\d{3})+(?![\d,]|\s\d)")
_ASSIGN = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")
_LEAD_REL = re.compile(r"^(?:\\approx|\\sim|\\simeq|=|≈)\s*")
_NUMBER_UNITS = re.compile(
    r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z][A-Za-z\s./]*(?:\^\{?[23]\}?)?[A-Za-z\s./]*)"
)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SPACES = re.compile(r"\s+")
_HEDGE_WORD = re.compile(r"(?<![A-Za-z\\])(?:or|and)(?![A-Za-z])")
_UNIT_STOPWORDS = {"or", "and", "to", "of", "plus", "minus", "times"}
_SINGLE_LETTER_UNITS = set("mgslhkjnwva")  # metres, grams, seconds, litres, hours, kelvin, joules, ...


def _is_unit(tail: str) -> bool:
    """`dollars`, `cm^2`, `km/h`, `m`; not `x` (`5x` is an expression) nor `or 18`-style hedges."""
    words = tail.lower().replace(".", " ").replace("/", " ").split()
    if not words or set(words) & _UNIT_STOPWORDS:
        return False
    first = re.match(r"[a-z]+", words[0]).group()
    return len(first) >= 2 or first in _SINGLE_LETTER_UNITS


def _canonical_number(s: str) -> str:
    """`+018.50` -> `18.5`, `-0.0` -> `0`, `.5` -> `0.5`: one spelling per decimal value."""
    sign = ""
    if s[:1] in "+-":
        sign, s = ("-" if s[0] == "-" else ""), s[1:]
    whole, _, frac = s.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else sign + out


def normalize_answer(s) -> str:
    """Canonical spelling of an answer: wrappers (`\\boxed`, `$`, `\\text{}`), units, currency, `%`,
    thousands separators, unicode minus, trailing period, leading zeros and trailing `.00` removed.

    `normalize_answer("\\$1,080.00") == "1080"`; `normalize_answer("x = 18 \\text{ cm}") == "18"`."""
    s = completion_text(s)
    if len(s) > MAX_ANSWER_CHARS:
        return s.strip()
    return _normalize_cached(s)


@lru_cache(maxsize=65_536)
def _normalize_cached(s: str) -> str:
    if not s:
        return ""
    s = s.translate(_UNICODE).strip()
    for _ in range(4):
        m = _BOX_WRAPPER.match(s)
        if m is None:
            break
        s = m.group(1).strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):
        s, n = _TEXT_WRAPPER.subn(lambda m: f" {m.group(1)} ", s)
        if not n:
            break
    s = _MATH_DELIMS.sub("", s)
    s = _LATEX_NOISE.sub(" ", s)
    s = _CURRENCY.sub("", s)
    s = _PERCENT.sub("", s)
    s = _DEGREES.sub("", s)
    s = _SPACES.sub(" ", s).strip()
    s = _LEAD_REL.sub("", s)
    s = _ASSIGN.sub("", s) if s.count("=") == 1 else s
    s = _THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group()), s)
    s = s.rstrip(" .;:")
    m = _NUMBER_UNITS.fullmatch(s)
    if m is not None and _is_unit(m.group(2)):
        s = m.group(1)
    if _PLAIN_NUMBER.fullmatch(s):
        return _canonical_number(s)
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1].strip()
        if _PLAIN_NUMBER.fullmatch(s):
            return _canonical_number(s)
    return s


# --------------------------------------------------------------------------------------------------
# values without sympy

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_RE_SCI = re.compile(
    rf"({_NUM})(?:[eE]([+-]?\d{{1,4}})|\s*(?:\\times|\\cdot|\*)\s*10\s*\^\s*(?:\{{\s*([+-]?\d{{1,4}})\s*\}}|([+-]?\d)))?"
)
_RE_POW10 = re.compile(r"([+-]?)10\s*\^\s*(?:\{\s*([+-]?\d{1,4})\s*\}|([+-]?\d))")
_RE_FRAC = re.compile(rf"([+-]?)\\frac\s*(?:\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}|(\d)\s*(\d))")
_RE_SLASH = re.compile(rf"\(?({_NUM})\)?\s*/\s*\(?({_NUM})\)?")
_RE_SQRT = re.compile(r"([+-]?)\\sqrt\s*(?:\{\s*(\d{1,40})\s*\}|(\d))")
_MAX_DIGITS = 4_000  # below Python's int-from-str limit (4300)
_MAX_EXPONENT = 1_000


def _fraction(s: str) -> Fraction | None:
    if len(s) > _MAX_DIGITS:
        return None
    return Fraction(s)


def numeric_value(s: str) -> Fraction | None:
    """Exact value of a normalised answer that is a plain number, decimal, scientific notation,
    fraction (`a/b`, `\\frac{a}{b}`) or a perfect root (`\\sqrt{324}`); None otherwise. No sympy."""
    try:
        return _numeric_value(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _numeric_value(s: str) -> Fraction | None:
    if not s or len(s) > _MAX_DIGITS:
        return None
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        s = s[1:-1].strip()
    m = _RE_SCI.fullmatch(s)
    if m is not None:
        value = _fraction(m.group(1))
        exp = m.group(2) or m.group(3) or m.group(4)
        if value is None or exp is None:
            return value
        exp = int(exp)
        return value * Fraction(10) ** exp if abs(exp) <= _MAX_EXPONENT else None
    m = _RE_POW10.fullmatch(s)
    if m is not None:
        exp = int(m.group(2) or m.group(3))
        return (-1 if m.group(1) == "-" else 1) * Fraction(10) ** exp if abs(exp) <= _MAX_EXPONENT else None
    m = _RE_FRAC.fullmatch(s)
    if m is not None:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        value = Fraction(num) / Fraction(den)
        return -value if m.group(1) == "-" else value
    m = _RE_SLASH.fullmatch(s)
    if m is not None:
        return Fraction(m.group(1)) / Fraction(m.group(2))
    m = _RE_SQRT.fullmatch(s)
    if m is not None:
        radicand = int(m.group(2) or m.group(3))
        root = math.isqrt(radicand)
        if root * root != radicand:
            return None
        return Fraction(-root if m.group(1) == "-" else root)
    return _arithmetic_value(s)


_FRAC_SIMPLE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_ARITH_OPS = re.compile(r"\\times|\\cdot|\\div|\\ast")
_ARITH_CHARS = re.compile(r"[\d\s.+\-*/()]+")
_ARITH_TOKEN = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?|[-+*/()])")
_MAX_ARITH_CHARS = 120


def _arithmetic_value(s: str) -> Fraction | None:
    """Value of plain arithmetic on numbers (`2 \\times 9`, `\\frac{36}{2} + 0`, `(3+3)*3`): + - * / and
    parentheses only, short and with bounded numbers, so it stays microseconds. No powers."""
    if len(s) > _MAX_ARITH_CHARS:
        return None
    for _ in range(4):
        s, n = _FRAC_SIMPLE.subn(r"((\1)/(\2))", s)
        if not n:
            break
    s = _ARITH_OPS.sub(lambda m: "/" if m.group() == "\\div" else "*", s)
    s = s.replace("{", "(").replace("}", ")")
    if not _ARITH_CHARS.fullmatch(s):
        return None
    tokens, pos = [], 0
    while pos < len(s):
        m = _ARITH_TOKEN.match(s, pos)
        if m is None:
            if s[pos:].strip():
                return None
            break
        tokens.append(m.group(1))
        pos = m.end()
    parser = _Arithmetic(tokens)
    value = parser.expr()
    return value if parser.pos == len(tokens) else None


class _Arithmetic:
    """Recursive descent over + - * / ( ) and numbers, exact with Fraction."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self) -> Fraction:
        tok = self._peek()
        if tok is None:
            raise ValueError("unexpected end")
        self.pos += 1
        if tok in ("+", "-"):
            value = self.factor()
            return -value if tok == "-" else value
        if tok == "(":
            self.depth += 1
            if self.depth > 20:
                raise ValueError("too deep")
            value = self.expr()
            if self._peek() != ")":
                raise ValueError("unbalanced")
            self.pos += 1
            self.depth -= 1
            return value
        if tok[0].isdigit():
            return Fraction(tok)
        raise ValueError(f"unexpected {tok!r}")


def _decimal_places(s: str) -> int:
    m = re.fullmatch(r"[+-]?\d*\.(\d+)", s)
    return len(m.group(1)) if m else 0


def _terminates(value: Fraction) -> bool:
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _values_equal(p: str, vp: Fraction, t: str, vt: Fraction) -> bool:
    if vp == vt:
        return True
    # A decimal with 3+ places stands for a repeating fraction it rounds to (0.333 <-> 1/3).
    for dec, vdec, other in ((p, vp, vt), (t, vt, vp)):
        k = _decimal_places(dec)
        if k >= 3 and not _terminates(other) and abs(vdec - other) <= Fraction(1, 2 * 10**k):
            return True
    return False


def _is_hedged(p: str) -> bool:
    """`17 or 18`, `17, 18`, `17; 18`: more than one candidate answer."""
    return "," in p or ";" in p or "\\pm" in p or "±" in p or _HEDGE_WORD.search(p) is not None


def same_answer(a, b) -> bool:
    """Quick equality of two answers by normalisation and exact value (no math-verify). Used to decide
    whether several boxes in one completion state the same answer."""
    pa, pb = normalize_answer(a), normalize_answer(b)
    if pa == pb:
        return True
    va, vb = numeric_value(pa), numeric_value(pb)
    return va is not None and vb is not None and _values_equal(pa, va, pb, vb)


# --------------------------------------------------------------------------------------------------
# equality


def answers_match(pred, truth, timeout: float | None = None) -> bool:
    """Whether `pred` states the same answer as `truth`, mathematically.

    Decided without sympy for the vast majority of answers (normalised text, then exact values).
    What that cannot decide goes to math-verify in a worker process, bounded by `timeout` seconds
    (default FALLBACK_TIMEOUT_S); an undecided comparison is False. Safe in any thread."""
    deadline = time.monotonic() + (FALLBACK_TIMEOUT_S if timeout is None else timeout)
    try:
        p, t = completion_text(pred).strip(), completion_text(truth).strip()
        if not p or not t:
            return False
        if len(p) > MAX_ANSWER_CHARS or len(t) > MAX_ANSWER_CHARS:
            return normalize_answer(p) == normalize_answer(t)
        verdict = _fast_match(normalize_answer(p), normalize_answer(t))
        if verdict is not None:
            return verdict
        return bool(_VERIFIER.check(normalize_answer(p), normalize_answer(t), deadline))
    except Exception:
        logger.debug("answers_match failed", exc_info=True)
        return False


_NON_MATH = re.compile(r"[A-Za-z ]+")
_TOWER = re.compile(
    r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\^\s*\{?\s*[+-]?\d{4,}|\d[eE][+-]?\d{5,}|\d{3,}\s*!|\\underbrace|\\overbrace"
)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_VARIABLE = re.compile(r"[A-DF-HJ-Za-df-hj-z]")  # any Latin letter but the constants e and i


@lru_cache(maxsize=65_536)
def _fast_match(p: str, t: str) -> bool | None:
    """True/False when plain normalisation decides, None when only math-verify can."""
    if not p or not t:
        return False
    if p == t:
        return True
    if not _is_hedged(t) and _is_hedged(p):
        return False
    vp, vt = numeric_value(p), numeric_value(t)
    if vp is not None and vt is not None:
        return _values_equal(p, vp, t, vt)
    if _NON_MATH.fullmatch(p) and _NON_MATH.fullmatch(t):
        return p.strip().lower() == t.strip().lower()  # words (`yes`, `B`): compare as words
    if vt is not None and not any(c.isdigit() for c in p) and "\\" not in p:
        return False  # a number against words: nothing for math-verify to find
    if vt is not None and _VARIABLE.search(_LATEX_COMMAND.sub(" ", p)):
        return False  # an expression in free variables (or prose) is not a number
    if len(p) > 200 or len(t) > 200 or _TOWER.search(p) or _TOWER.search(t):
        return False  # exponent towers, huge factorials: sympy could run for minutes
    return None


# --------------------------------------------------------------------------------------------------
# math-verify worker process

_WORKER_SOURCE = r"""
import json, logging, os, sys
os.nice(10)  # sympy must not starve the trainer (or the caller waiting on this worker) of CPU
logging.disable(logging.CRITICAL)
from math_verify import parse, verify

def check(pred, gold):
    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))

for pred, gold in [("\\sqrt{8}", "2\\sqrt{2}"), ("3\\times 6", "18"), ("x = 18", "18"), ("\\frac{\\pi}{2}", "\\pi/2"),
                   ("2^{1/2}", "\\sqrt{2}"), ("(1, 2)", "(1,2)"), ("x^2+1", "1+x^2"), ("\\{1,2\\}", "\\{2,1\\}")]:
    check(pred, gold)
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin:
    try:
        rid, pred, gold = json.loads(line)
    except Exception:
        continue
    try:
        ok = check(pred, gold)
    except Exception:
        ok = False
    sys.stdout.write(json.dumps([rid, ok]) + "\n")
    sys.stdout.flush()
"""


class _MathVerifyWorker:
    """Client of one persistent math-verify process. A call waits for its answer until a deadline, then
    gives up (None); the late answer is kept for the next identical call. A worker busy for longer than
    `runaway_s` on one request is killed and replaced."""

    def __init__(self, startup_timeout: float = 120.0, runaway_s: float = 2.0, max_results: int = 65_536):
        self.startup_timeout = startup_timeout
        self.runaway_s = runaway_s
        self.max_results = max_results
        self._lock = threading.Lock()
        self._started = threading.Event()  # first start attempt finished (ready or failed)
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self._ready = False
        self._failed = False
        self._buf = b""
        self._next_id = 0
        self._pending: dict[int, tuple[tuple[str, str], float]] = {}
        self._results: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self.stats = {"calls": 0, "answered": 0, "timeouts": 0, "busy": 0, "restarts": 0}

    # public -------------------------------------------------------------------------------------
    def check(self, pred: str, gold: str, deadline: float) -> bool | None:
        key = (pred, gold)
        cached = self._results.get(key)
        if cached is not None:
            return cached
        self.stats["calls"] += 1
        if not self._started.is_set():
            self.warm_up()  # one-off start, outside any per-call deadline
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self.stats["busy"] += 1
            return None
        try:
            return self._check_locked(key, deadline)
        except Exception:
            logger.debug("math-verify worker failed", exc_info=True)
            self._kill()
            return None
        finally:
            self._lock.release()

    def warm_up(self) -> bool:
        """Start the worker and wait until it is ready; True when it is."""
        with self._lock:
            if self._proc is None and not self._failed:
                self._spawn()
                self._wait_ready(time.monotonic() + self.startup_timeout)
            self._started.set()
            return self._ready

    def close(self) -> None:
        self._kill()

    # internals ----------------------------------------------------------------------------------
    def _check_locked(self, key, deadline):
        if self._failed:
            return None
        if self._owner_pid != os.getpid():  # forked child: the pipes belong to the parent's worker
            self._proc, self._ready, self._buf = None, False, b""
            self._pending.clear()
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        if not self._ready and not self._wait_ready(deadline):
            return None
        # Answers to earlier, timed-out requests come first; wait for them within this call's budget.
        while self._pending:
            oldest = min(t for _, t in self._pending.values())
            if time.monotonic() - oldest > self.runaway_s:
                self._kill()
                self.stats["restarts"] += 1
                self._spawn()
                return None
            if self._read_until(None, deadline) is None and self._pending:
                self.stats["busy"] += 1
                return None
        if self._proc is None:  # died while answering an earlier request
            self._spawn()
            return None
        rid = self._next_id
        self._next_id += 1
        self._pending[rid] = (key, time.monotonic())
        os.write(self._proc.stdin.fileno(), (json.dumps([rid, key[0], key[1]]) + "\n").encode())
        found = self._read_until(rid, deadline)
        if found is None:
            self.stats["timeouts"] += 1
        else:
            self.stats["answered"] += 1
        return found

    def _spawn(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_SOURCE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                bufsize=0,
            )
        except OSError as err:
            self._failed = True
            logger.warning("math-verify worker could not start (%s); symbolic answers will score 0.", err)
            return
        self._owner_pid = os.getpid()
        self._ready = False
        self._buf = b""
        self._pending.clear()

    def _wait_ready(self, deadline: float) -> bool:
        line = self._readline(deadline)
        if line == b"ready":
            self._ready = True
        elif line is not None or (self._proc is not None and self._proc.poll() is not None):
            self._failed = True
            logger.warning("math-verify worker exited at start; symbolic answers will score 0.")
            self._kill()
        return self._ready

    def _readline(self, deadline: float | None) -> bytes | None:
        """One line from the worker, waiting until `deadline` (None: do not wait)."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            wait = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, 65_536)
            if not chunk:  # worker died
                self._kill()
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.strip()

    def _read_until(self, rid: int | None, deadline: float | None) -> bool | None:
        """Collect answers (caching late ones) until `rid` is answered (rid None: any answer) or the
        deadline passes."""
        while self._proc is not None:
            line = self._readline(deadline)
            if line is None:
                return None
            try:
                got, ok = json.loads(line)
            except ValueError:
                continue
            entry = self._pending.pop(got, None)
            if entry is not None:
                self._remember(entry[0], bool(ok))
            if rid is None or got == rid:
                return bool(ok)
        return None

    def _remember(self, key, ok: bool):
        self._results[key] = ok
        if len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def _kill(self):
        proc, self._proc = self._proc, None
        self._ready = False
        self._pending.clear()
        self._buf = b""
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass


_VERIFIER = _MathVerifyWorker()
atexit.register(_VERIFIER.close)


def warm_up_verifier() -> bool:
    """Start the math-verify worker now (about a second), so the first symbolic comparison inside a
    training step does not pay for it. Optional: the first comparison that needs it starts it anyway."""
    return _VERIFIER.warm_up()

