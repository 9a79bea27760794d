"""The base model under a LoRA checkpoint: its name and a fingerprint of the function it computes.

An adapter is only meaningful on the model it was trained on. Every checkpoint records the server's base model when
it is saved (`BaseModel`, in its record); a server whose base differs refuses to load, sample from, resume or teach
with it (`mismatch`). Names can differ for the same model (a copied folder, a hub id and its cache folder) and match
for different ones (two servers' stand-ins under one served name), so the fingerprint decides.

The fingerprint (`model_fingerprint`) covers what changes the model's function: every parameter and buffer (name,
shape, values rounded to bf16) and the config's architecture fields (`ARCHITECTURE_FIELDS`: sizes, activation,
normalisation epsilon, rotary settings, windows, ...). It cannot see differences below bf16's resolution, nor code
outside the config (a patched transformers, another attention kernel).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

FINGERPRINT_SCHEME = "sha256-model-bf16"
# The scheme of earlier versions: the parameters alone (`BaseModel.weights_only`; only adopting their records uses it)
WEIGHTS_ONLY_SCHEME = "sha256-bf16"
# Config fields that change what a model computes with the same weights, in the families transformers ships (a field a
# config does not have is left out). Rotary settings sit in `rope_parameters` in transformers 5 and in `rope_theta` /
# `rope_scaling` before; sub-configs (`text_config`, ...) are read the same way.
ARCHITECTURE_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation", "rms_norm_eps",
    "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "full_attention_interval", "attention_bias", "mlp_bias", "qkv_bias", "tie_word_embeddings",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "embedding_multiplier",
    "logits_scaling", "residual_multiplier", "attention_multiplier", "logit_scale", "num_experts",
    "num_experts_per_tok", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "use_qk_norm", "qk_layernorm",
    "no_rope_layers", "pretraining_tp", "scale_embedding",
)  # fmt: skip


@dataclass(frozen=True)
class BaseModel:
    name: str  # the model as the server was given it: a folder, a hub id
    fingerprint: str  # `model_fingerprint`; "" for a checkpoint saved before checkpoints recorded their base
    # the served model's fingerprint in `WEIGHTS_ONLY_SCHEME` (what records of earlier versions hold); "" in records
    weights_only: str = field(default="", compare=False, repr=False)

    def short(self) -> str:
        """The fingerprint as messages show it (scheme and 12 hex digits)."""
        if not self.fingerprint:
            return "unknown"
        scheme, _, digest = self.fingerprint.partition(":")
        return f"{scheme}:{digest[:12]}"


UNKNOWN_BASE = BaseModel("", "")  # a checkpoint saved before checkpoints recorded their base


def served_base(name: str, model: torch.nn.Module) -> BaseModel:
    """The `BaseModel` of `model`, served as `name`: its fingerprint and its weights-only one, in one pass over the
    tensors. Call it before PEFT wraps the model (LoRA layers rename the base weights) and before the frozen linears
    are cast for bf16 sampling."""
    full, weights_only = _fingerprints(model)
    return BaseModel(name, full, weights_only)


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over the architecture fields of `model`'s config (`config_fields`), then every parameter and every
    buffer (name, shape, values rounded to bf16), each in name order.

    Rounded to bf16 so a model loaded in float32 and in bfloat16 (``--dtype``) fingerprints alike, as its adapters
    fit both; a float16 load rounds differently and fingerprints apart."""
    return _fingerprints(model)[0]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint of earlier versions: SHA-256 over the parameters alone (`WEIGHTS_ONLY_SCHEME`)."""
    return _fingerprints(model)[1]


def config_fields(config) -> dict:
    """The architecture fields of a transformers config (`ARCHITECTURE_FIELDS`), its sub-configs' under their names."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def select(values: dict) -> dict:
        chosen = {k: values[k] for k in ARCHITECTURE_FIELDS if values.get(k) is not None}
        for key, value in values.items():
            if key.endswith("_config") and isinstance(value, dict):
                chosen[key] = select(value)
        return chosen

    return select(data)


def _fingerprints(model: torch.nn.Module) -> tuple[str, str]:
    full, weights_only = hashlib.sha256(), hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        text = json.dumps(config_fields(config), sort_keys=True, separators=(",", ":"), default=str)
        full.update(b"config:" + text.encode() + b";")
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        values = _bf16_bytes(param)
        head = f"{name}:{tuple(param.shape)};".encode()
        for digest in (full, weights_only):
            digest.update(head)
            digest.update(values)
    for name, buffer in sorted(model.named_buffers(), key=lambda item: item[0]):
        full.update(f"buffer {name}:{tuple(buffer.shape)};".encode())
        full.update(_bf16_bytes(buffer) if buffer.is_floating_point() else buffer.detach().cpu().numpy().tobytes())
    return f"{FINGERPRINT_SCHEME}:{full.hexdigest()}", f"{WEIGHTS_ONLY_SCHEME}:{weights_only.hexdigest()}"


def _bf16_bytes(tensor: torch.Tensor):
    return tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy()


def short_name(name: str) -> str:
    """`name` as an answer to a client shows it: a hub id as it is, a local folder by its last part only (where a
    model lies on the server's disk is no client's business; the server's log has the full path)."""
    if os.path.isabs(name):
        return os.path.basename(os.path.normpath(name)) or name
    return name


def mismatch(uri: str, trained_on: BaseModel, served: BaseModel) -> str | None:
    """The one-line refusal of checkpoint `uri`, trained on `trained_on`, on a server serving `served`; None when the
    fingerprints are equal. A checkpoint that records no base model cannot be checked, so it is refused too. Models
    are named by `short_name`: the answer holds no path."""
    if trained_on.fingerprint and trained_on.fingerprint == served.fingerprint:
        return None
    if not trained_on.fingerprint:
        return (
            f"checkpoint {uri} records no base model (saved before checkpoints recorded theirs), so it cannot be "
            f"checked against this server's {short_name(served.name)!r}: refused. Load its adapter files with PEFT "
            "on the base it was trained on, or train it again"
        )
    return (
        f"checkpoint {uri} was trained on base model {short_name(trained_on.name)!r} ({trained_on.short()}), but "
        f"this server serves {short_name(served.name)!r} ({served.short()}): an adapter only fits the model it was "
        "trained on. Use it on a server started with that model (--model)"
    )
