"""Training datums for the PyTRIO GRPO loop: one per sampled completion, shifted for next-token prediction.

The trainer scores ``target_tokens[t]`` given ``model_input[: t + 1]``, so for a prompt ``p`` (length P) and a
completion ``c`` (length C) the datum holds ``input = p + c[:-1]`` and ``targets = [0] * (P - 1) + c`` (both
``P + C - 1`` long). The sampler's logprobs and the advantage are zero over the prompt positions, so prompt tokens
carry no loss for the policy losses; `shifted_sequences`' ``mask`` marks the positions that count for a custom loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    tool_mask: Sequence[int] | None = None,
) -> dict[str, list]:
    """Plain-list form of one datum: ``input``, ``target_tokens``, ``logprobs``, ``advantages``, ``mask``.
    `advantage`: one value for every completion token, or one per completion token (on-policy distillation).

    With a multi-turn completion's `tool_mask` (0 on the tokens tools wrote), those tokens stay in the input (the
    model attends to them) with zero advantage and zero mask: no weight in any loss."""
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
    weights = [1.0] * len(completion_tokens)
    if tool_mask is not None:
        if len(tool_mask) != len(completion_tokens) or any(m not in (0, 1) for m in tool_mask):
            raise ValueError("cannot build a training datum: tool_mask must be 0/1, one per completion token")
        weights = [float(m) for m in tool_mask]
    return {
        "input": list(prompt_tokens) + list(completion_tokens[:-1]),
        "target_tokens": [0] * pad + list(completion_tokens),
        "logprobs": [0.0] * pad + [float(x) for x in completion_logprobs],
        "advantages": [0.0] * pad + [a * w for a, w in zip(per_token, weights, strict=True)],
        "mask": [0.0] * pad + weights,
    }


def build_datum(
    prompt_tokens, completion_tokens, completion_logprobs, advantage: float | Sequence[float], tool_mask=None
):
    """A `pytrio.Datum` for the ``importance_sampling`` / ``ppo`` / ``cispo`` losses (no ``mask`` key: the
    wire format has none; custom losses use `shifted_sequences`' ``mask``)."""
    import pytrio as trio

    seq = shifted_sequences(prompt_tokens, completion_tokens, completion_logprobs, advantage, tool_mask)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(seq["input"]),
        loss_fn_inputs={
            "target_tokens": seq["target_tokens"],
            "logprobs": seq["logprobs"],
            "advantages": seq["advantages"],
        },
    )
