"""The trained policy of a truncating sampler: TRL 1.16's fused LM head with the processed distribution's log-probs.

TRL scores completions through ``add_fused_lm_head``: ``model(..., labels=..., fused_lm_head=True)`` returns each
labelled token's log-prob under the tempered logits, over the whole vocabulary. Where sampling truncates (``top_k``,
``top_p`` or ``min_p``), the sampler draws from the tempered logits truncated and renormalised over the kept tokens,
so the ratio of a sampler's log-probs to those would carry each position's kept mass (trl#6789). `add_truncated_lm_head`
re-patches the same models (the policy, the reference, a distillation teacher) so the fused forward returns the
log-probs (and entropy) of the processed distribution (`trl_grpo_ext.grpo.sampling_distribution.support_logprobs`):
the backbone and the head's scaling are TRL's, the vocabulary side runs a chunk of positions at a time, each chunk
checkpointed (backward recomputes its logits instead of keeping them). Without truncation TRL's head stays.
"""

from __future__ import annotations

import functools
import types
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings, support_logprobs
from trl_grpo_ext.trl.internals.mirroring import mirrors

# Positions whose vocabulary-wide logits one chunk holds (a few of them at once: logits, the truncation's sort, the
# log-softmax): 256 x 49,152 floats is 50 MB, 256 x 151,936 is 156 MB.
POSITION_CHUNK = 256


def _logit_transform(text_config) -> tuple[float, float | None]:
    """(logit scale, final softcapping) of the model's head, read as TRL 1.16's ``add_fused_lm_head`` reads them."""
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else scale), softcap


def _chunk(hidden, weight, bias, targets, scale, softcap, temperature, settings, with_entropy):
    z = torch.nn.functional.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logps, entropy = support_logprobs(z * (1.0 / temperature), targets, settings, with_entropy)
    return (logps, entropy) if with_entropy else (logps,)


@mirrors("trl.trainer.utils.add_fused_lm_head", {"1.16.0": "cec86deee35d8b64"}, part="the fused forward")
def add_truncated_lm_head(model, temperature: float, settings: SamplingSettings, cast_lm_head_to_fp32: bool = False):
    """Make `model`'s fused forward (TRL's, added already) score the processed distribution of `settings`: the same
    call and output (``log_probs``, ``entropy``, ``loss``, ``label_mask``), the backbone run as TRL runs it. MoE
    models' load-balancing loss is not computed here (refused before: `truncation_problems`)."""
    fused = model.forward  # TRL's: without ``fused_lm_head`` it is the model's own forward
    text_config = model.config.get_text_config()
    scale, softcap = _logit_transform(text_config)

    # the model's own signature, as TRL keeps it: generate reads it (position ids, logits_to_keep)
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                         **kwargs)  # fmt: skip
        kwargs["use_cache"] = False
        backbone_outputs = self.base_model(*args, **kwargs)  # transformers >= 5: the backbone of every model
        if shift_labels is None:
            hidden_states = backbone_outputs.last_hidden_state[:, :-1]
            labels = labels[:, 1:]
        else:
            hidden_states = backbone_outputs.last_hidden_state
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        hidden_states = hidden_states.to(lm_head.weight.device)
        labels = labels.to(lm_head.weight.device)
        mask = labels != -100
        autocast_ctx = nullcontext()
        if cast_lm_head_to_fp32:
            hidden_states = hidden_states.float()
            autocast_ctx = torch.autocast(hidden_states.device.type, enabled=False)
        weight, bias = lm_head.weight, lm_head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            if bias is not None:
                bias = bias.full_tensor()
        rows, targets = hidden_states[mask], labels[mask]  # only the labelled positions are scored
        with_entropy = True
        logps, entropies = [], []
        with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):
            for start in range(0, rows.shape[0], POSITION_CHUNK):
                args_ = (rows[start : start + POSITION_CHUNK], weight, bias, targets[start : start + POSITION_CHUNK],
                         scale, softcap, temperature, settings, with_entropy)  # fmt: skip
                if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
                    out = checkpoint(_chunk, *args_, use_reentrant=False)
                else:
                    out = _chunk(*args_)
                logps.append(out[0])
                entropies.append(out[1])
        flat_logps = torch.cat(logps) if logps else rows.new_zeros(0, dtype=torch.float32)
        flat_entropy = torch.cat(entropies) if entropies else rows.new_zeros(0, dtype=torch.float32)
        # `masked_scatter` keeps the output connected to the model even when no label is valid (as TRL's head does)
        log_probs = flat_logps.new_zeros(mask.shape).masked_scatter(mask, flat_logps)
        entropy = flat_entropy.new_zeros(mask.shape).masked_scatter(mask, flat_entropy)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(forward, model)


def truncation_problems(model) -> list[str]:
    """What the truncated head cannot score (`add_truncated_lm_head`): MoE models' load-balancing loss."""
    text_config = model.config.get_text_config()
    if getattr(text_config, "output_router_logits", False):
        return [
            "top_k / top_p / min_p with a mixture-of-experts model: the trained policy's truncated log-probs do not "
            "compute its load-balancing loss; sample without truncation or set output_router_logits: false"
        ]
    return []
