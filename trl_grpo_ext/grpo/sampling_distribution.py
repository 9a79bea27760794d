"""The distribution a sampler draws each token from, defined once for every sampler and for the trained policy.

A sampler with ``temperature`` T, ``top_k``, ``top_p`` and ``min_p`` draws from the *processed* distribution: the
logits divided by T, then truncated (top-k, then top-p, then min-p, each on what the one before kept, as transformers'
warpers run), renormalised over the tokens kept. Its token log-probs (`processed_logprobs`) are the behaviour policy
of every off-policy correction, whichever sampler drew them: the TRL path's ``generate``
(`trl_grpo_ext.trl.sampler_precision`), the local PyTRIO server (`trl_grpo_ext.pytrio_server.decoding`), vLLM (with
``logprobs_mode: processed_logprobs``, its own rule; TRL's convention).

The trained policy is the same distribution of the trainer's logits (`support_logprobs`): tempered as TRL tempers it
and, where sampling truncates, truncated by the same rule and renormalised over the kept tokens. So at staleness 0 in
one precision the importance ratio of every token is 1 to float rounding at any setting; with the trainer's
log-probs taken over the whole vocabulary instead, a truncating sampler's ratio would carry the kept mass of each
position (trl#6789). The sampled token is always kept on the trainer's side: a token the trainer's own rule would
cut (a stale sample, or rounding at the boundary) keeps a finite log-prob instead of -inf, as prime-rl's replay does.

The ops mirror transformers 5.25's ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
``MinPLogitsWarper`` (``min_tokens_to_keep=1``) one for one, so a sampler that applies them itself draws the tokens
transformers' own warpers would draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the maths runs: the configs read `SamplingSettings` without it
    import torch


@dataclass(frozen=True)
class SamplingSettings:
    """A sampler's settings: TRL's names (``top_k`` 0 or negative: off, vLLM's and PyTRIO's -1 too; ``min_p`` None
    or 0: off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None

    @classmethod
    def of(cls, config) -> SamplingSettings:
        """The settings of `config` (either path's, or anything with TRL's field names)."""
        top_k = getattr(config, "top_k", 0)
        return cls(
            temperature=float(getattr(config, "temperature", 1.0)),
            top_k=int(top_k) if top_k is not None else 0,
            top_p=float(getattr(config, "top_p", 1.0) if getattr(config, "top_p", None) is not None else 1.0),
            min_p=getattr(config, "min_p", None) or None,
        )

    @property
    def truncates(self) -> bool:
        """Whether some tokens are cut: the trained policy is then renormalised over the kept ones."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p is not None

    @property
    def plain(self) -> bool:
        """Temperature 1 and nothing cut: the processed distribution is the model's own softmax."""
        return self.temperature == 1.0 and not self.truncates

    def describe(self) -> str:
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k > 0:
            parts.append(f"top_k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top_p {self.top_p:g}")
        if self.min_p is not None:
            parts.append(f"min_p {self.min_p:g}")
        return ", ".join(parts)


def truncate(scores: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """`scores` (..., V), tempered already, with the tokens top-k, top-p and min-p cut set to -inf (transformers'
    warpers' ops, in their order)."""
    import torch

    minus_inf = -float("inf")
    if settings.top_k > 0:
        k = min(settings.top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], minus_inf)
    if settings.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative_probs <= (1 - settings.top_p)
        remove[..., -1:] = 0  # the most likely token is always kept
        scores = scores.masked_fill(remove.scatter(-1, sorted_indices, remove), minus_inf)
    if settings.min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < settings.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, minus_inf)
    return scores


def processed_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The scores a sampler draws from (softmax of them): `logits` / T, then `truncate`d."""
    scores = logits / settings.temperature if settings.temperature != 1.0 else logits
    return truncate(scores, settings) if settings.truncates else scores


def processed_logprobs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Log-probabilities (..., V) of the distribution a sampler draws from (-inf on the tokens cut), in float32."""
    import torch

    return torch.log_softmax(processed_logits(logits, settings).float(), dim=-1)


def support_logprobs(
    tempered: torch.Tensor, tokens: torch.Tensor, settings: SamplingSettings, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trained policy's log-prob of `tokens` (N,) under `tempered` logits (N, V) (divided by T already, as TRL's
    fused head divides them), truncated as `settings` truncate and renormalised over the kept tokens plus the token
    itself; differentiable. With `with_entropy`, the entropy of that distribution too. Without truncation: the
    tempered log-softmax (TRL's)."""
    import torch

    if settings.truncates:
        with torch.no_grad():
            cut = torch.isneginf(truncate(tempered.detach(), settings))
            cut.scatter_(-1, tokens[:, None], False)
        tempered = tempered.masked_fill(cut, -float("inf"))
    logps = torch.log_softmax(tempered.float(), dim=-1)
    token_logps = logps.gather(-1, tokens[:, None]).squeeze(-1)
    if not with_entropy:
        return token_logps, None
    # the cut tokens' terms are 0 (p = 0); masked before the product, so no 0 * -inf reaches the backward
    safe = logps.masked_fill(torch.isneginf(logps), 0.0)
    return token_logps, -(safe.exp() * safe).masked_fill(torch.isneginf(logps), 0.0).sum(-1)
