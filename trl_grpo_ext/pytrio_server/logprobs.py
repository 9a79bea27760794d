"""Token log-probabilities without full-vocabulary copies: the decoder's last hidden states, then the output layer
and a selective log-softmax a chunk of positions at a time.

``log_softmax(logits).gather(target)`` over a (tokens, vocab) tensor holds several vocabulary-wide copies per token
(the logits, the log-softmax kept for backward, their gradients): 0.2 MB each per token on a 49k vocabulary, most of a
long item's memory. Here the output layer runs on `LOGIT_CHUNK` positions at a time and each chunk's log-probs are
``logit[target] - logsumexp(logits)`` (TRL's `selective_log_softmax`, written here because importing trl's trainer
utilities adds seconds to the server's start); under autograd each chunk is checkpointed, so backward recomputes its
logits instead of keeping them. Memory for the vocabulary side is then one chunk's, whatever the length.

Long plain forward/backward batches also checkpoint the decoder's layers (`layer_checkpointing`): only each layer's
input is kept, and backward recomputes one layer at a time, so the saved activations (1.4 MB per token on the
embedded model, 12 tensors per layer) shrink to one hidden vector per layer and token. Without dropout the
recomputation is the same computation: outputs and gradients do not change.

Where the output layer is not just a function of the last hidden state (a model that scales or caps its logits in
its own forward), `split_head_exact` finds out at load by comparing both on a probe, and the engine uses the model's
logits instead (still gathered a chunk at a time).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from trl_grpo_ext.compat import output_cache

LOGIT_CHUNK = 256  # positions per output-layer call: 256 x 49k vocab x 4 bytes = 50 MB of logits at a time


def selective_logprobs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at `index` ((..., K) per position), without the full log-softmax tensor."""
    logits = logits.float()
    return logits.gather(-1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)


class TokenLogprobs:
    """The part of `ModelEngine` that turns the model's hidden states into token log-probs (uses ``base``, ``peft``
    and ``split_head``)."""

    def decode(self, **inputs) -> tuple[torch.Tensor, object]:
        """(per-position features, KV cache) of a forward with the active adapter: the decoder's last hidden states
        (the output layer runs later, in chunks) or, where that split is not exact, the model's logits."""
        if self.split_head:
            out = self.base.get_decoder()(**inputs)
            return out.last_hidden_state, output_cache(out)
        out = (self.peft if self.peft is not None else self.base)(**inputs)
        return out.logits, output_cache(out)

    def token_logprobs(self, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Log-probs of `index` ((..., T) one target per position, or (..., T, K)) under `features` (..., T, F)."""
        squeeze = index.dim() == features.dim() - 1
        if squeeze:
            index = index.unsqueeze(-1)
        lead = features.shape[:-1]
        flat, flat_index = features.reshape(1, -1, features.shape[-1]), index.reshape(1, -1, index.shape[-1])
        pieces = []
        for start in range(0, flat.shape[1], LOGIT_CHUNK):
            part, part_index = flat[:, start : start + LOGIT_CHUNK], flat_index[:, start : start + LOGIT_CHUNK]
            if torch.is_grad_enabled() and part.requires_grad:  # backward recomputes this chunk's logits
                pieces.append(checkpoint(self._chunk_logprobs, part, part_index, use_reentrant=False))
            else:
                pieces.append(self._chunk_logprobs(part, part_index))
        if not pieces:  # no positions
            return features.new_zeros(index.shape[:-1] if squeeze else index.shape)
        out = torch.cat(pieces, dim=1).reshape(*lead, index.shape[-1])
        return out.squeeze(-1) if squeeze else out

    @contextlib.contextmanager
    def layer_checkpointing(self, enabled: bool):
        """Within: the decoder layers keep only their inputs for backward and recompute the rest (no caches may be
        used meanwhile: a recomputed layer would write its cache again)."""
        layers = checkpointable_layers(self.base) if enabled and self.can_checkpoint else []
        for layer in layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
            layer.train()  # transformers checkpoints in training mode only; there is no dropout to switch on
        try:
            yield
        finally:
            for layer in layers:
                layer.gradient_checkpointing = False
                layer.eval()

    def token_topk(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` most likely tokens of each position of `features` (T, F) and their log-probs, (T, k) each."""
        values, indices = [features.new_zeros(0, k)], [torch.zeros(0, k, dtype=torch.long, device=features.device)]
        for start in range(0, features.shape[0], LOGIT_CHUNK):
            part = features[start : start + LOGIT_CHUNK]
            logits = (self.base.get_output_embeddings()(part) if self.split_head else part).float()
            top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
            values.append(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
            indices.append(top.indices)
        return torch.cat(values), torch.cat(indices)

    def _chunk_logprobs(self, part: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        logits = self.base.get_output_embeddings()(part) if self.split_head else part
        return selective_logprobs(logits, index)


def split_head_exact(model, vocab_size: int) -> bool:
    """Whether ``output layer(decoder(x))`` equals ``model(x).logits`` (no extra logit transform in the model)."""
    ids = torch.arange(1, 9, device=model.device).remainder(vocab_size)[None]
    try:
        with torch.no_grad():
            whole = model(input_ids=ids).logits.float()
            split = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state).float()
    except Exception:  # noqa: BLE001 - a model without the usual decoder/output split
        return False
    return whole.shape == split.shape and torch.equal(whole, split)


def checkpointable_layers(model) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointing_exact(model) -> bool:
    """Whether recomputing `model`'s layers in training mode is the same computation (no dropout anywhere)."""
    config = model.config
    rates = [v for k, v in vars(config).items() if "dropout" in k and isinstance(v, (int, float))]
    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return bool(checkpointable_layers(model)) and not any(r > 0 for r in rates + dropouts)
