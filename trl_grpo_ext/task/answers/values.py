"""Exact values of numeric answers, without sympy and without a clock.

`exact_value` reads a normalised answer as arithmetic on numbers: integers and decimals, scientific
notation (`1.5e3`, `1.5 \\times 10^{3}`), fractions (`\\frac{a}{b}`, `\\frac12`, `a/b`), mixed numbers
(`2\\frac{1}{2}`, `2 1/2`), `+ - * / \\times \\cdot \\div`, parentheses and braces, integer powers
(`2^{3}`, `2^-1`, `2**3`), rational powers of positive rationals (`8^{2/3}`, `2^{1/2}`), roots
(`\\sqrt{2}`, `\\sqrt[3]{27}`, `\\sqrt[3]{-8}` = -2) and factorials (`4!`, `0!`).

Values are exact: a `Fraction`, or a `Surd` `coef * radicand ** (1 / index)` in a canonical form (the
radicand an integer > 1 with no `index`-th power factor, the index as small as it can be), so two
values are equal exactly when their representations are: `\\sqrt{8}` = `2\\sqrt{2}` = `\\frac{4}{\\sqrt{2}}`.
Sums of unlike roots (`\\sqrt{2} + \\sqrt{3}`) and everything with letters are not read here (None):
math-verify may decide those.

Work is bounded by input size, never by time: past one of the limits below, `Refused` is raised and
the comparison that asked scores not equal, the same on every machine.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from trl_grpo_ext.task.answers.arithmetic import (
    MAX_DEPTH,
    MAX_DIGITS,
    MAX_EXPONENT,
    MAX_EXPRESSION_CHARS,
    Refused,
    Surd,
    Unsupported,
    Value,
    add,
    checked,
    factorial,
    inv,
    mul,
    neg,
    power,
    root,
)


def exact_value(answer: str) -> Fraction | Surd | None:
    """Exact value of a normalised answer, None when it is not arithmetic on numbers; raises `Refused`
    past a size limit. Same input, same result, in any process."""
    outcome, payload = _exact_value_cached(answer)
    if outcome == "refused":
        raise Refused(payload)
    return payload


@lru_cache(maxsize=65_536)
def _exact_value_cached(answer: str):
    try:
        return "value", _evaluate(answer)
    except Refused as err:
        return "refused", str(err)
    except Unsupported:
        return "value", None


_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRAC_DIGITS = re.compile(r"\\frac\s*(\d)\s*(\d)")  # LaTeX's `\frac12`
_SQRT_DIGIT = re.compile(r"\\sqrt\s*(\d)")  # `\sqrt2`
_MIXED_LATEX = re.compile(r"(?<![\d.}^_])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_MIXED_SLASH = re.compile(r"([+-]?)(\d+) (\d+)/(\d+)")
_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+(?:\.\d*)?|\.\d+))(?:[eE](?P<exp>[+-]?\d+))?"
    r"|(?P<cmd>\\(?:frac|sqrt|times|cdot|div|ast))(?![A-Za-z])"
    r"|(?P<op>\*\*|[-+*/^!(){}\[\]]))"
)
_OPS = {"\\times": "*", "\\cdot": "*", "\\ast": "*", "\\div": "/", "**": "^"}


def _evaluate(s: str) -> Value | None:
    s = s.strip()
    if not s:
        return None
    if _PLAIN_NUMBER.fullmatch(s):
        return _number(s.lstrip("+"), None)
    if len(s) > MAX_EXPRESSION_CHARS:
        raise Refused(f"an expression longer than {MAX_EXPRESSION_CHARS} characters")
    m = _MIXED_SLASH.fullmatch(s)
    if m is not None and 0 < int(m.group(3)) < int(m.group(4)):
        s = f"{m.group(1)}({m.group(2)}+{m.group(3)}/{m.group(4)})"
    s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_DIGIT.sub(r"\\sqrt{\1}", s)
    s = _MIXED_LATEX.sub(_mixed_number, s)
    tokens = _tokens(s)
    if tokens is None:
        return None
    return _Parser(tokens).parse()


def _mixed_number(m: re.Match) -> str:
    """`2\\frac{1}{2}` is two and a half (a whole number then a proper fraction); `2\\frac{3}{2}` stays
    a product."""
    whole, num, den = m.groups()
    if 0 < int(num) < int(den):
        return f"({whole}+\\frac{{{num}}}{{{den}}})"
    return m.group()


def _tokens(s: str) -> list | None:
    tokens, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:
            return None if s[pos:].strip() else tokens
        pos = m.end()
        if m.group("num") is not None:
            tokens.append(_number(m.group("num"), m.group("exp")))
        else:
            text = m.group("cmd") or m.group("op")
            tokens.append(_OPS.get(text, text))
    return tokens


def _number(digits: str, exponent: str | None) -> Fraction:
    if sum(c.isdigit() for c in digits) > MAX_DIGITS:
        raise Refused(f"a number with more than {MAX_DIGITS} digits")
    value = Fraction(digits)
    if exponent is not None:
        if len(exponent.lstrip("+-")) > 5 or abs(int(exponent)) > MAX_EXPONENT:
            raise Refused(f"an exponent beyond ±{MAX_EXPONENT}")
        value *= Fraction(10) ** int(exponent)
    return checked(value)


class _Parser:
    """Recursive descent over the tokens of `_tokens` (Fractions and operator strings):

    expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary | implicit product)*
    unary := ('+'|'-') unary | power ; power := postfix ('^' unary)? ; postfix := atom '!'*
    atom := number | '(' expr ')' | '{' expr '}' | \\frac{}{} | \\sqrt[n]{}
    An implicit product (`2\\sqrt{2}`, `3(4)`) needs a bracket, `\\frac` or `\\sqrt` on its right: two
    numbers side by side (`2 3`) are not read."""

    _IMPLICIT = ("(", "{", "\\frac", "\\sqrt")

    def __init__(self, tokens: list):
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def parse(self) -> Value:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise Unsupported
        return value

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self):
        tok = self._peek()
        if tok is None:
            raise Unsupported
        self.pos += 1
        return tok

    def _expect(self, tok: str):
        if self._take() != tok:
            raise Unsupported

    def expr(self) -> Value:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self.term()
            value = add(value, rhs if op == "+" else neg(rhs))
        return value

    def term(self) -> Value:
        value = self.unary()
        while True:
            tok = self._peek()
            if tok in ("*", "/"):
                self.pos += 1
                rhs = self.unary()
                value = mul(value, rhs if tok == "*" else inv(rhs))
            elif isinstance(tok, str) and tok in self._IMPLICIT:
                value = mul(value, self.power())
            else:
                return value

    def unary(self) -> Value:
        if self._peek() in ("+", "-"):
            op = self._take()
            value = self.unary()
            return neg(value) if op == "-" else value
        return self.power()

    def power(self) -> Value:
        base = self.postfix()
        if self._peek() == "^":
            self.pos += 1
            return power(base, self.unary())
        return base

    def postfix(self) -> Value:
        value = self.atom()
        while self._peek() == "!":
            self.pos += 1
            value = factorial(value)
        return value

    def _group(self, close: str) -> Value:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused(f"nesting deeper than {MAX_DEPTH}")
        value = self.expr()
        self._expect(close)
        self.depth -= 1
        return value

    def atom(self) -> Value:
        tok = self._take()
        if isinstance(tok, Fraction):
            return tok
        if tok == "(":
            return self._group(")")
        if tok == "{":
            return self._group("}")
        if tok == "\\frac":
            self._expect("{")
            num = self._group("}")
            self._expect("{")
            return mul(num, inv(self._group("}")))
        if tok == "\\sqrt":
            index = Fraction(2)
            if self._peek() == "[":
                self.pos += 1
                index = self._group("]")
            self._expect("{")
            return root(self._group("}"), index)
        raise Unsupported


# -------------------------------------------------------------------------------------------- equality


_DECIMAL = re.compile(r"[+-]?\d*\.(\d+)")


def _decimal_places(s: str) -> int:
    m = _DECIMAL.fullmatch(s)
    return len(m.group(1)) if m else 0


def _terminates(value: Fraction) -> bool:
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _surd_within(s: Surd, lo: Fraction, hi: Fraction) -> bool:
    """lo <= s <= hi, exactly (s = c x with x = radicand^(1/index) > 0)."""
    c = s.coef
    if c < 0:
        c, lo, hi = -c, -hi, -lo
    upper, lower = hi / c, lo / c
    if upper <= 0 or s.radicand > upper**s.index:
        return False
    return lower <= 0 or s.radicand >= lower**s.index


# Value notations that contain an operator sign without being arithmetic left to do: a leading or bracketed sign,
# exponents (`10^{-2}`, `2^-1`), scientific notation (`1.5e-3`, `1.5 \\times 10^{3}`), a fraction of two integers
# (`3/4`, `-3/4`), a mixed number (`2 1/2`).
_SIGN_AFTER_BRACKET = re.compile(r"(^|[({\[])\s*[+-]")
_EXPONENT_PART = re.compile(r"\^\s*(?:\{[^{}]*\}|[+-]?\d+)|(?<=\d)[eE][+-]?\d+")
_SCIENTIFIC = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)\s*(?:\*|\\times|\\cdot)\s*10\s*\^")
_INTEGER_FRACTION = re.compile(r"[+-]?(?:\d+ )?\d+\s*/\s*\d+")
_ARITHMETIC_OPERATOR = re.compile(r"[-+*/]|\\(?:times|cdot|div|ast)(?![A-Za-z])")


def is_unevaluated_arithmetic(answer: str) -> bool:
    """Whether a normalised answer is arithmetic left to do (`1 - 8`, `32 + 28`, `3 \\times 6`, `2(4+5)`,
    `\\frac{1+2}{3}`) rather than one value in one notation (`-7`, `3/4`, `2\\frac{1}{2}`, `2^{3}`, `4!`, `\\sqrt{2}`,
    `1.5 \\times 10^{3}`).

    A final answer that still holds the question's arithmetic is not credited against a numeric truth
    (`equality.decide`): on arithmetic tasks copying the question into the box would otherwise score as
    solving it, and RL finds that within a few dozen steps (docs/rewards.md)."""
    s = answer.strip()
    if _INTEGER_FRACTION.fullmatch(s):
        return False
    s = _SCIENTIFIC.sub("", s)
    s = _EXPONENT_PART.sub("", s)
    s = _SIGN_AFTER_BRACKET.sub(r"\1", s)
    if re.search(r"\d\s*\(|\)\s*\(|\)\s*\d", s):  # implicit products: `2(4+5)`, `(2)(9)`
        return True
    return _ARITHMETIC_OPERATOR.search(s) is not None


def values_equal(p: str, vp: Value, t: str, vt: Value) -> bool:
    """Equality of two exact values (`p`, `t`: the normalised texts they came from).

    Equal values are equal. Besides, a decimal written with 3+ places stands for a non-terminating value
    it rounds to: `0.333` = `1/3` and `1.414` = `\\sqrt{2}` (within half a unit of its last place);
    with fewer places it must be exact (`0.33` != `1/3`, `1.41` != `\\sqrt{2}`)."""
    if vp == vt:
        return True
    for dec, vdec, other in ((p, vp, vt), (t, vt, vp)):
        k = _decimal_places(dec)
        if k < 3 or not isinstance(vdec, Fraction):
            continue
        half = Fraction(1, 2 * 10**k)
        if isinstance(other, Surd):
            if _surd_within(other, vdec - half, vdec + half):
                return True
        elif not _terminates(other) and abs(vdec - other) <= half:
            return True
    return False
