"""How an estimate, its interval and a test read in a report: `+0.06 [−0.02, +0.14]`, `p=1e-5`, and the verdict
`A − B = +0.06 [−0.02, +0.14]: not significant at 95%`."""

from __future__ import annotations

from trl_grpo_ext.report.stats import CONFIDENCE, Interval

MINUS = "\u2212"  # typographic minus, as in the verdict strings


def signed(x: float, digits: int = 2) -> str:
    """`+0.06`, `−0.02` (typographic minus), `+0.00`."""
    text = f"{abs(x):.{digits}f}"
    return ("+" if x >= 0 or float(text) == 0 else MINUS) + text


def format_p(p: float) -> str:
    """McNemar / test p-values: `0.031`, `1e-5` (no padded exponent), `<1e-300`."""
    if p >= 0.001:
        return f"{p:.2g}" if p < 0.1 else f"{p:.2f}"
    if p <= 0:
        return "<1e-300"
    mantissa, exponent = f"{p:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def interval_text(
    estimate: float,
    low: float | None,
    high: float | None,
    digits: int = 2,
    sign: bool = True,
    missing: str = " (no interval)",
) -> str:
    """`+0.06 [−0.02, +0.14]` (`sign`: explicit signs, typographic minus) or `0.300 [0.250, 0.350]`; the estimate
    followed by `missing` when there is no interval."""

    def number(x: float) -> str:
        return signed(x, digits) if sign else f"{x:.{digits}f}"

    if low is None or high is None:
        return number(estimate) + missing
    return f"{number(estimate)} [{number(low)}, {number(high)}]"


def format_interval(iv: Interval, digits: int = 2) -> str:
    """`+0.06 [−0.02, +0.14]`, or `+0.06 (no interval)` when the data give none."""
    return interval_text(iv.estimate, iv.low, iv.high, digits)


def verdict(a: str, b: str, iv: Interval, confidence: float = CONFIDENCE, digits: int = 2) -> str:
    """`A − B = +0.06 [−0.02, +0.14]: not significant at 95%` (significant: the interval excludes 0)."""
    level = f"{confidence * 100:g}%"
    head = f"{a} {MINUS} {b} = {format_interval(iv, digits)}"
    if not iv.has_interval:
        return f"{head}: no verdict (needs at least 2 seeds per configuration)"
    return f"{head}: {'significant' if iv.significant else 'not significant'} at {level}"
