"""Training datums for the PyTRIO GRPO loop: one per sampled completion, shifted for next-token prediction.

The trainer scores ``target_tokens[t]`` given ``model_input[: t + 1]``, so for a prompt ``p`` (length P) and a
completion ``c`` (length C) the datum holds ``input = p + c[:-1]`` and ``targets = [0] * (P - 1) + c`` (both
``P + C - 1`` long). The sampler's logprobs and the advantage are zero over the prompt positions, so prompt tokens
carry no loss for the policy losses; `shifted_sequences`' ``mask`` marks the positions that count for a custom loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt, as the sampler returned it."""

    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    stop_reason: str = ""


def validate_rollout(prompt_tokens: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]) -> str | None:
    """Why a sampled sequence cannot be trained on, or ``None`` if it can."""
    if len(prompt_tokens) < 1:
        return "empty prompt"
    if len(tokens) < 1:
        return "empty completion"
    if len(logprobs) != len(tokens):
        return f"{len(logprobs)} logprobs for {len(tokens)} tokens"
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        return "token ids must be non-negative integers"
    if any(not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-4 for lp in logprobs):
        return "logprobs must be finite and <= 0"
    return None


def shifted_sequences(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    completion_logprobs: Sequence[float],
    advantage: float | Sequence[float],
) -> dict[str, list]:
    """Plain-list form of one datum: ``input``, ``target_tokens``, ``logprobs``, ``advantages``, ``mask``.
    `advantage`: one value for every completion token, or one per completion token (on-policy distillation)."""
    problem = validate_rollout(prompt_tokens, completion_tokens, completion_logprobs)
    if problem:
        raise ValueError(f"cannot build a training datum: {problem}")
    pad = len(prompt_tokens) - 1
    completion_len = len(completion_tokens)
    per_token = (
        [float(a) for a in advantage] if isinstance(advantage, (list, tuple)) else [float(advantage)] * completion_len
    )
    if len(per_token) != completion_len:
        raise ValueError(f"cannot build a training datum: {len(per_token)} advantages for {completion_len} tokens")
    if not all(math.isfinite(a) for a in per_token):
        raise ValueError(f"cannot build a training datum: advantage is {advantage}")
    return {
        "input": list(prompt_tokens) + list(completion_tokens[:-1]),
        "target_tokens": [0] * pad + list(completion_tokens),
        "logprobs": [0.0] * pad + [float(x) for x in completion_logprobs],
        "advantages": [0.0] * pad + [float(a) for a in per_token],
        "mask": [0.0] * pad + [1.0] * completion_len,
    }


def build_datum(prompt_tokens, completion_tokens, completion_logprobs, advantage: float | Sequence[float]):
    """A `pytrio.Datum` for the ``importance_sampling`` / ``ppo`` / ``cispo`` losses (no ``mask`` key: the
    wire format has none; custom losses use `shifted_sequences`' ``mask``)."""
    import pytrio as trio

    seq = shifted_sequences(prompt_tokens, completion_tokens, completion_logprobs, advantage)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(seq["input"]),
        loss_fn_inputs={
            "target_tokens": seq["target_tokens"],
            "logprobs": seq["logprobs"],
            "advantages": seq["advantages"],
        },
    )
