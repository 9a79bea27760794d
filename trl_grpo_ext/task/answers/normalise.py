"""String normalisation of answers: one spelling per answer (wrappers, units, currency, separators,
leading zeros and trailing `.00` removed), and the last number of a text in that spelling."""

from __future__ import annotations

import re
from functools import lru_cache

from trl_grpo_ext.task.answers.text import completion_text

# Answers longer than this are compared as text only; no real final answer is this long.
MAX_ANSWER_CHARS = 1_000

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
_NUMBER_UNITS = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z][A-Za-z\s./]*(?:\^\{?[23]\}?)?[A-Za-z\s./]*)")
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


def canonical_number(s: str) -> str:
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
        return canonical_number(s)
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1].strip()
        if _PLAIN_NUMBER.fullmatch(s):
            return canonical_number(s)
    return s


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
            return canonical_number(last.group().replace(",", ""))
        if start == 0:
            return None
        size *= 8


def is_hedged(answer: str) -> bool:
    """`17 or 18`, `17, 18`, `17; 18`, `\\pm 18`: more than one candidate answer (on normalised text)."""
    return (
        "," in answer or ";" in answer or "\\pm" in answer or "±" in answer or _HEDGE_WORD.search(answer) is not None
    )
