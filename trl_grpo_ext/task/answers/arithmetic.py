"""Exact arithmetic on the values of numeric answers: `Fraction`s and irrational roots kept in a canonical
form (`Surd`), each operation bounded by the stated size limits (past one, `Refused`), never by a clock. What has
no exact form here (unlike roots added, a root of a root, complex roots) raises `Unsupported`: math-verify may
decide it. `trl_grpo_ext.task.answers.values` reads answers into these values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

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


class Unsupported(Exception):
    """Not arithmetic this module reads (letters, unlike roots added, complex roots)."""


@dataclass(frozen=True)
class Surd:
    """`coef * radicand ** (1 / index)`, irrational, in canonical form (see the module docstring)."""

    coef: Fraction
    index: int
    radicand: int


Value = Fraction | Surd


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def checked(value: Value) -> Value:
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
        raise Unsupported
    if coef == 0 or radicand == 0:
        return Fraction(0)
    if radicand < 0:
        if index % 2 == 0:
            raise Unsupported  # not real
        coef, radicand = -coef, -radicand  # odd roots of negatives are real: cbrt(-8) = -2
    p, q = radicand.numerator, radicand.denominator
    if q != 1:  # (p/q)^(1/n) = (p q^(n-1))^(1/n) / q
        if p.bit_length() + q.bit_length() * (index - 1) > MAX_VALUE_BITS:
            raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
        p, coef = p * q ** (index - 1), coef / q
    exact = _iroot(p, index)
    if exact**index == p:
        return checked(coef * exact)
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
        return checked(coef * inside)
    return checked(Surd(coef, index, inside))


def neg(a: Value) -> Value:
    return Surd(-a.coef, a.index, a.radicand) if isinstance(a, Surd) else -a


def add(a: Value, b: Value) -> Value:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return checked(a + b)
    if a == 0:
        return b
    if b == 0:
        return a
    if isinstance(a, Surd) and isinstance(b, Surd) and (a.index, a.radicand) == (b.index, b.radicand):
        coef = a.coef + b.coef
        return checked(Surd(coef, a.index, a.radicand)) if coef else Fraction(0)
    raise Unsupported  # unlike roots, or a root plus a rational: no canonical form here


def mul(a: Value, b: Value) -> Value:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return checked(a * b)
    if isinstance(a, Fraction) or isinstance(b, Fraction):
        f, s = (a, b) if isinstance(a, Fraction) else (b, a)
        return Fraction(0) if f == 0 else checked(Surd(f * s.coef, s.index, s.radicand))
    index = math.lcm(a.index, b.index)
    if index > MAX_ROOT_INDEX:
        raise Unsupported
    radicand = a.radicand ** (index // a.index) * b.radicand ** (index // b.index)
    return _surd(a.coef * b.coef, index, Fraction(radicand))


def inv(a: Value) -> Value:
    if isinstance(a, Surd):  # 1/(c r^(1/n)) = (r^(n-1))^(1/n) / (c r)
        return _surd(1 / (a.coef * a.radicand), a.index, Fraction(a.radicand ** (a.index - 1)))
    if a == 0:
        raise Refused("division by zero")
    return 1 / a


def power(base: Value, exponent: Value) -> Value:
    if isinstance(exponent, Surd):
        raise Unsupported
    if exponent.denominator != 1:  # b^(p/q) = (b^p)^(1/q) for a positive rational b
        if isinstance(base, Surd) or base < 0 or exponent.denominator > MAX_ROOT_INDEX:
            raise Unsupported
        return _surd(Fraction(1), exponent.denominator, power(base, Fraction(exponent.numerator)))
    k = exponent.numerator
    if abs(k) > MAX_EXPONENT:
        raise Refused(f"an exponent beyond ±{MAX_EXPONENT}")
    if k < 0:
        base, k = inv(base), -k
    if isinstance(base, Surd):
        if max(_bits(base.coef), base.radicand.bit_length()) * k > MAX_VALUE_BITS:
            raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
        # (c r^(1/n))^k = c^k r^(k//n) (r^(k%n))^(1/n): only the small leftover power needs a canonical form
        whole = base.coef**k * base.radicand ** (k // base.index)
        return mul(checked(whole), _surd(Fraction(1), base.index, Fraction(base.radicand ** (k % base.index))))
    if _bits(base) * k > MAX_VALUE_BITS:
        raise Refused(f"a value beyond {MAX_VALUE_BITS} bits")
    return base**k


def root(value: Value, index: Value) -> Value:
    if isinstance(index, Surd) or index.denominator != 1 or index < 2:
        raise Unsupported
    if index > MAX_ROOT_INDEX:
        raise Refused(f"a root of index above {MAX_ROOT_INDEX}")
    if isinstance(value, Surd):
        raise Unsupported
    return _surd(Fraction(1), int(index), value)


def factorial(value: Value) -> Value:
    if isinstance(value, Surd) or value.denominator != 1:
        raise Unsupported
    if value < 0:
        raise Refused("factorial of a negative number")
    if value > MAX_FACTORIAL:
        raise Refused(f"a factorial above {MAX_FACTORIAL}!")
    return Fraction(math.factorial(int(value)))
