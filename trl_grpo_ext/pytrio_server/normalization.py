"""Loss normalisation from the client's ``gradient_accumulation`` totals (the pytrio v2 protocol).

pytrio (0.2.8, 0.2.9) splits one logical ``forward_backward`` into micro-batches (events) and sends with each the same
totals of the whole logical batch (`pytrio.client.training_batch.plan_training_batch`): ``total_samples``,
``total_active_tokens`` (valid targets after ``auto_shift``; for ``cross_entropy`` those with a non-zero weight) and
``total_advantage_tokens`` (valid targets with a non-zero advantage, "the denominator of DRO-like normalisation").
Each micro-batch's summed loss is divided by the logical batch's denominator for its loss, so the gradients the
micro-batches accumulate add up to the logical batch's per-token mean, however the batch was split:

=====================  ===================================  ==========================
loss                   counted tokens (the server's mask)   denominator
=====================  ===================================  ==========================
cross_entropy          valid targets with ``w != 0``        ``total_active_tokens``
importance_sampling    valid targets                        ``total_active_tokens``
ppo, cispo             valid targets                        ``total_active_tokens``
dro                    valid targets with ``A != 0``        ``total_advantage_tokens``
=====================  ===================================  ==========================

The counted tokens of each loss are exactly what the client counts into that total, so an honest client's
micro-batch never counts more tokens than its denominator; a request that does (or sends totals that are not
positive integers within `MAX_TOTAL`, or fewer samples than it carries) is refused, as a hostile client's would be.
A request without totals keeps the plain sum (Tinker's documented semantics).
"""

from __future__ import annotations

from dataclasses import dataclass

NORMALIZATIONS = ("client_totals", "sum")
MAX_TOTAL = 2**40  # far above any batch a server can hold; a larger total only serves to shrink gradients to nothing
TOTAL_FIELDS = ("total_samples", "total_active_tokens", "total_advantage_tokens")


class TotalsError(ValueError):
    """Totals no honest client sends (code ``invalid_gradient_accumulation``)."""


@dataclass(frozen=True)
class Totals:
    samples: int
    active_tokens: int
    advantage_tokens: int


def parse_totals(raw: object) -> Totals | None:
    """The totals of a ``forward_backward`` payload's ``gradient_accumulation`` (None when absent), each an integer
    in [0, `MAX_TOTAL`] (``total_samples`` at least 1); `TotalsError` otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TotalsError(
            f"gradient_accumulation must be a map of {', '.join(TOTAL_FIELDS)}, got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - set(TOTAL_FIELDS))
    if unknown:
        raise TotalsError(f"gradient_accumulation has unknown fields {unknown}; it takes {', '.join(TOTAL_FIELDS)}")
    values = []
    for name in TOTAL_FIELDS:
        value = raw.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TotalsError(f"gradient_accumulation.{name} must be an integer, got {value!r}")
        low = 1 if name == "total_samples" else 0
        if not low <= value <= MAX_TOTAL:
            raise TotalsError(f"gradient_accumulation.{name} must lie in [{low}, {MAX_TOTAL}], got {value}")
        values.append(value)
    return Totals(*values)


def denominator(loss: str, totals: Totals) -> int:
    """The logical batch's count of the tokens `loss` counts (see the module's table)."""
    return totals.advantage_tokens if loss == "dro" else totals.active_tokens


def counted_tokens(loss: str, targets: list[int], weights, advantages, auto_shift: bool) -> int:
    """The tokens of one datum that `loss` counts: the server's mask, the client's count (pure Python)."""
    count = 0
    for i, target in enumerate(targets):
        if target == -100 or (auto_shift and i == 0):
            continue
        if loss == "cross_entropy" and float(weights[i]) == 0.0:
            continue
        if loss == "dro" and float(advantages[i]) == 0.0:
            continue
        count += 1
    return count


def loss_scale(loss: str, totals: Totals | None, samples: int, counted: int, mode: str = "client_totals") -> float:
    """The factor a micro-batch's summed loss is multiplied by before its backward: ``1 / denominator`` with totals
    (and `mode` ``client_totals``), 1 without. `TotalsError` for totals this micro-batch contradicts (`samples` data
    carrying `counted` counted tokens)."""
    if totals is None or mode == "sum":
        return 1.0
    if samples > totals.samples:
        raise TotalsError(
            f"gradient_accumulation.total_samples {totals.samples} is below the {samples} samples of this request"
        )
    total = denominator(loss, totals)
    field = "total_advantage_tokens" if loss == "dro" else "total_active_tokens"
    if counted > total:
        raise TotalsError(
            f"gradient_accumulation.{field} {total} is below the {counted} tokens {loss} counts in this request"
        )
    return 1.0 / total if total else 1.0  # no counted token anywhere: the loss is 0 and so is its gradient
