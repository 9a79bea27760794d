"""Tolerances of the tests that compare two computations of the same numbers, per compute precision.

fp32: float rounding of reordered sums only. bf16 autocast keeps 8 significant bits: one rounding is off by up to
eps/2 (eps = 2**-7, `torch.finfo(torch.bfloat16).eps`). Two layouts of the same batch (packed vs padded rows, one
event vs several, a chunk of rows vs one row) round at different places, so a log-prob of O(1) logits may differ by
a few roundings (2 eps); a loss sum is a sum of them (2 eps relative); a gradient multiplies rounded activations by
rounded upstream gradients through each layer's backward (8 eps relative, per tensor, as a norm). On the tiny test
model the measured differences stay below 0.5, 0.3 and 2.5 eps; a wrong mask, row or scale differs by order 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    name: str
    logprob: float  # absolute, per token (log-probs, per-token losses)
    loss_sum: float  # relative (and absolute near zero)
    grad: float  # relative, per tensor: norm(a - b) <= grad * norm(b)


BF16_EPS = torch.finfo(torch.bfloat16).eps
FP32 = Tolerance("fp32", logprob=1e-4, loss_sum=1e-5, grad=1e-5)
BF16 = Tolerance("bf16", logprob=2 * BF16_EPS, loss_sum=2 * BF16_EPS, grad=8 * BF16_EPS)


def tolerance(bf16: bool) -> Tolerance:
    return BF16 if bf16 else FP32


def assert_grads_close(got: dict, want: dict, tol: Tolerance) -> None:
    """Every tensor of `got` within `tol.grad` (relative, as a norm) of `want`'s, the same names on both sides."""
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        diff = float((got[name].float() - grad.float()).norm())
        assert diff <= tol.grad * max(float(grad.norm()), 1e-6), f"{name}: {diff} vs norm {float(grad.norm())}"
