"""The build-batch phase: a scored batch as the datums the service trains on (`trl_grpo_ext.pytrio.datums`) and the
local loss's `TokenRows`."""

from __future__ import annotations

from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.datums import build_datum, shifted_sequences
from trl_grpo_ext.pytrio.types import ScoredBatch, TokenRows, TrainBatch


def build_train_batch(config: PyTrioGRPOConfig, scored: ScoredBatch, step: int) -> TrainBatch:
    """One `pytrio.Datum` per completion with tokens (`trl_grpo_ext.pytrio.datums`); empty completions count for
    the rewards and the group baseline only."""
    advantages = scored.advantages if scored.token_advantages is None else scored.token_advantages
    staleness = scored.staleness or [0] * len(scored.rollouts)
    kept = [(r, a, s) for r, a, s in zip(scored.rollouts, advantages, staleness, strict=True) if r.completion_tokens]
    if not kept:
        raise PyTrioLoopError(f"step {step + 1}: every completion was empty; nothing to train on")
    trained = [(r, a) for r, a, _ in kept]
    token_rows = TokenRows()
    for rollout, adv, stale in kept:
        token_rows.add(
            shifted_sequences(
                rollout.prompt_tokens, rollout.completion_tokens, rollout.completion_logprobs, adv, rollout.tool_mask
            ),
            stale,
        )
    # The service sums a built-in loss over tokens; dividing the advantages by the batch's completion tokens
    # turns that sum into TRL's token-level mean ("dapo" normalisation) for both linear-in-A losses.
    scale = 1.0
    if config.uses_builtin_loss and config.loss_aggregation == "token_mean":
        scale = 1.0 / max(token_rows.completion_tokens, 1)
    per_token = scored.token_advantages is not None
    datums = [
        build_datum(
            r.prompt_tokens,
            r.completion_tokens,
            r.completion_logprobs,
            [x * scale for x in a] if per_token else a * scale,
            r.tool_mask,
        )
        for r, a in trained
    ]
    if per_token:  # tokens with a non-zero advantage of their own, tool tokens left out
        train_tokens = sum(
            sum(x != 0.0 and (r.tool_mask is None or r.tool_mask[i]) for i, x in enumerate(a)) for r, a in trained
        )
    else:
        train_tokens = sum(r.model_tokens for r, a in zip(scored.rollouts, scored.advantages, strict=True) if a != 0.0)
    return TrainBatch(datums, token_rows, train_tokens)
