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

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

# Limits; past any of them an answer is refused (`Refused`), never computed.
MAX_EXPRESSION_CHARS = 200  # a normalised answer longer than this is not read as arithmetic
MAX_DIGITS = 1_000  # digits in one number
MAX_EXPONENT = 1_000  # |k| in `a^k` and in `1e{k}`
MAX_VALUE_BITS = 16_384  # bits of a numerator, denominator or radicand (about 4,900 decimal digits)
MAX_FACTORIAL = 100  # largest n in `n!`
MAX_ROOT_INDEX = 10  # largest n in `\sqrt[n]{}` (and denominator of a rational exponent)
MAX_RADICAND = 10**12  # a root of a larger integer must come out exact (a perfect power)
MAX_DEPTH = 20  # nesting of parentheses / braces / `\frac` / `\sqrt`


class Refused(ValueError):
    """An answer past one of the stated size limits, or undefined (division by zero)."""


class _Unsupported(Exception):
    """Not arithmetic this module reads (letters, unlike roots added, complex roots)."""


@dataclass(frozen=True)
class Surd:
    """`coef * radicand ** (1 / index)`, irrational, in canonical form (see the module docstring)."""

    coef: Fraction
    index: int
    radicand: int


Value = Fraction | Surd


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
    except _Unsupported:
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
    return _checked(value)


# -------------------------------------------------------------------------------------------- arithmetic


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _checked(value: Value) -> Value:
    if isinstance(value, Surd):
        if max(_bits(value.coef), value.radicand.bit_length()) > MAX_VALUE_BITS:
            raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
    elif _bits(value) > MAX_VALUE_BITS:
        raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
    return value


def _iroot(x: int, n: int) -> int:
    """floor(x ** (1/n)) for x >= 0, in integers (Newton's method from above)."""
    if x < 2:
        return x
    if n == 2:
        return math.isqrt(x)
    r = 1 << -(-x.bit_length() // n)  # >= the root
    while True:
        s = ((n - 1) * r + x // r ** (n - 1)) // n
        if s >= r:
            return r
        r = s


def _prime_factors(n: int) -> list[int]:
    return [p for p in range(2, n + 1) if n % p == 0 and all(p % q for q in range(2, p))]


def _surd(coef: Fraction, index: int, radicand: Fraction) -> Value:
    """`coef * radicand ** (1/index)` in canonical form (a Fraction when it is rational)."""
    if index > MAX_ROOT_INDEX:
        raise _Unsupported
    if coef == 0 or radicand == 0:
        return Fraction(0)
    if radicand < 0:
        if index % 2 == 0:
            raise _Unsupported  # not real
        coef, radicand = -coef, -radicand  # odd roots of negatives are real: cbrt(-8) = -2
    p, q = radicand.numerator, radicand.denominator
    if q != 1:  # (p/q)^(1/n) = (p q^(n-1))^(1/n) / q
        if p.bit_length() + q.bit_length() * (index - 1) > MAX_VALUE_BITS:
            raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
        p, coef = p * q ** (index - 1), coef / q
    root = _iroot(p, index)
    if root**index == p:
        return _checked(coef * root)
    if p > MAX_RADICAND:
        raise Refused(f"a root of an integer above {MAX_RADICAND:.0e} that is not a perfect power")
    # Move index-th powers out by trial division up to m^(1/(index+1)); what is left then has at most
    # `index` prime factors, so it holds an index-th power only if it is one.
    outside, inside, m, d = 1, 1, p, 2
    while d ** (index + 1) <= m:
        if m % d == 0:
            e = 0
            while m % d == 0:
                m //= d
                e += 1
            outside *= d ** (e // index)
            inside *= d ** (e % index)
        d += 1 if d == 2 else 2
    r = _iroot(m, index)
    if r**index == m:
        outside *= r
    else:
        inside *= m
    # Smallest index: a radicand that is a perfect j-th power (j a prime factor of the index) is reduced.
    reduced = True
    while reduced and index > 1:
        reduced = False
        for j in _prime_factors(index):
            r = _iroot(inside, j)
            if r**j == inside:
                inside, index, reduced = r, index // j, True
                break
    coef *= outside
    if index == 1 or inside == 1:
        return _checked(coef * inside)
    return _checked(Surd(coef, index, inside))


def _neg(a: Value) -> Value:
    return Surd(-a.coef, a.index, a.radicand) if isinstance(a, Surd) else -a


def _add(a: Value, b: Value) -> Value:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _checked(a + b)
    if a == 0:
        return b
    if b == 0:
        return a
    if isinstance(a, Surd) and isinstance(b, Surd) and (a.index, a.radicand) == (b.index, b.radicand):
        coef = a.coef + b.coef
        return _checked(Surd(coef, a.index, a.radicand)) if coef else Fraction(0)
    raise _Unsupported  # unlike roots, or a root plus a rational: no canonical form here


def _mul(a: Value, b: Value) -> Value:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _checked(a * b)
    if isinstance(a, Fraction) or isinstance(b, Fraction):
        f, s = (a, b) if isinstance(a, Fraction) else (b, a)
        return Fraction(0) if f == 0 else _checked(Surd(f * s.coef, s.index, s.radicand))
    index = math.lcm(a.index, b.index)
    if index > MAX_ROOT_INDEX:
        raise _Unsupported
    radicand = a.radicand ** (index // a.index) * b.radicand ** (index // b.index)
    return _surd(a.coef * b.coef, index, Fraction(radicand))


def _inv(a: Value) -> Value:
    if isinstance(a, Surd):  # 1/(c r^(1/n)) = (r^(n-1))^(1/n) / (c r)
        return _surd(1 / (a.coef * a.radicand), a.index, Fraction(a.radicand ** (a.index - 1)))
    if a == 0:
        raise Refused("division by zero")
    return 1 / a


def _power(base: Value, exponent: Value) -> Value:
    if isinstance(exponent, Surd):
        raise _Unsupported
    if exponent.denominator != 1:  # b^(p/q) = (b^p)^(1/q) for a positive rational b
        if isinstance(base, Surd) or base < 0 or exponent.denominator > MAX_ROOT_INDEX:
            raise _Unsupported
        return _surd(Fraction(1), exponent.denominator, _power(base, Fraction(exponent.numerator)))
    k = exponent.numerator
    if abs(k) > MAX_EXPONENT:
        raise Refused(f"an exponent beyond ±{MAX_EXPONENT}")
    if k < 0:
        base, k = _inv(base), -k
    if isinstance(base, Surd):
        if max(_bits(base.coef), base.radicand.bit_length()) * k > MAX_VALUE_BITS:
            raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
        # (c r^(1/n))^k = c^k r^(k//n) (r^(k%n))^(1/n): only the small leftover power needs a canonical form
        whole = base.coef**k * base.radicand ** (k // base.index)
        return _mul(_checked(whole), _surd(Fraction(1), base.index, Fraction(base.radicand ** (k % base.index))))
    if _bits(base) * k > MAX_VALUE_BITS:
        raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
    return base**k


def _root(value: Value, index: Value) -> Value:
    if isinstance(index, Surd) or index.denominator != 1 or index < 2:
        raise _Unsupported
    if index > MAX_ROOT_INDEX:
        raise Refused(f"a root of index above {MAX_ROOT_INDEX}")
    if isinstance(value, Surd):
        raise _Unsupported
    return _surd(Fraction(1), int(index), value)


def _factorial(value: Value) -> Value:
    if isinstance(value, Surd) or value.denominator != 1:
        raise _Unsupported
    if value < 0:
        raise Refused("factorial of a negative number")
    if value > MAX_FACTORIAL:
        raise Refused(f"a factorial above {MAX_FACTORIAL}!")
    return Fraction(math.factorial(int(value)))


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
            raise _Unsupported
        return value

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self):
        tok = self._peek()
        if tok is None:
            raise _Unsupported
        self.pos += 1
        return tok

    def _expect(self, tok: str):
        if self._take() != tok:
            raise _Unsupported

    def expr(self) -> Value:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self.term()
            value = _add(value, rhs if op == "+" else _neg(rhs))
        return value

    def term(self) -> Value:
        value = self.unary()
        while True:
            tok = self._peek()
            if tok in ("*", "/"):
                self.pos += 1
                rhs = self.unary()
                value = _mul(value, rhs if tok == "*" else _inv(rhs))
            elif isinstance(tok, str) and tok in self._IMPLICIT:
                value = _mul(value, self.power())
            else:
                return value

    def unary(self) -> Value:
        if self._peek() in ("+", "-"):
            op = self._take()
            value = self.unary()
            return _neg(value) if op == "-" else value
        return self.power()

    def power(self) -> Value:
        base = self.postfix()
        if self._peek() == "^":
            self.pos += 1
            return _power(base, self.unary())
        return base

    def postfix(self) -> Value:
        value = self.atom()
        while self._peek() == "!":
            self.pos += 1
            value = _factorial(value)
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
            return _mul(num, _inv(self._group("}")))
        if tok == "\\sqrt":
            index = Fraction(2)
            if self._peek() == "[":
                self.pos += 1
                index = self._group("]")
            self._expect("{")
            return _root(self._group("}"), index)
        raise _Unsupported


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
