"""Numbers of a metric's curve over optimizer steps: its moving average and its mean level."""

from __future__ import annotations


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average; the first points average over what exists so far."""
    if window <= 1 or not values:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def normalized_auc(steps: list[float], values: list[float]) -> float | None:
    """Trapezoid area under the curve divided by the step span: the run's average level over training."""
    if not values:
        return None
    if len(values) == 1 or steps[-1] == steps[0]:
        return values[-1]
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(values) - 1))
    return area / (steps[-1] - steps[0])
