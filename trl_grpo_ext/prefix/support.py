"""When sharing is exact for a model (`packed_unsupported_reason` for the packed training forward,
`sharing_unsupported_reason` for the KV-cache paths), and the once-per-process log of why not."""

from __future__ import annotations

import logging

# the package's name, as when this was the one module `trl_grpo_ext/prefix.py` (log filters and tests use it)
logger = logging.getLogger(__package__)

# KV-cache sharing (generation): attention implementations that take a 2D mask with holes
# and a cache exactly as the plain forward does (tested).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# The packed forward (training log-probs, the local PyTRIO server's forward/backward): sdpa, flash-attention and
# flex-attention run it through `attention.SegmentAttention`, eager through a dense 4D mask.
PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Decoder families with standard RoPE on explicit position_ids and one full-attention mask for every layer.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "phi3", "smollm3")
# RoPE variants whose frequencies don't depend on the sequence length ("dynamic" and "longrope" do).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_LOGGED: set[str] = set()


def log_fallback_once(reason: str) -> None:
    """Log (once per process and reason) why the plain path is used."""
    log_prefix_once(f"prompt-prefix sharing not applied, plain forward used: {reason}")


def log_prefix_once(message: str) -> None:
    """Log `message` once per process."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning("%s", message)


def _unwrap(model):
    """The model inside DDP-style wrappers (``.module``); a PEFT model stays itself."""
    inner = model
    for _ in range(4):
        if hasattr(inner, "module") and not hasattr(inner, "config"):
            inner = inner.module
    return inner


def _config_of(model):
    """The text config of a (possibly PEFT- or DDP-wrapped) model."""
    config = getattr(_unwrap(model), "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _model_unsupported_reason(model) -> str | None:
    """Why the model (whatever its attention implementation) can't be packed or share a cache exactly, or None."""
    config = _config_of(model)
    if config is None:
        return f"{type(model).__name__} has no config"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    layer_types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if (layer_types and any(t != "full_attention" for t in layer_types)) or sliding is not None:
        return "sliding-window layers need their own mask"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} depends on the sequence length"
    inner = _unwrap(model)
    peft_config = getattr(inner, "active_peft_config", None) if hasattr(inner, "peft_config") else None
    if getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning PEFT adapters prepend virtual tokens to every row"
    return None


def sharing_unsupported_reason(model) -> str | None:
    """Why a shared KV cache (`shared_prefix_generate`) would not reproduce
    `model`'s plain forward exactly, or ``None`` if it would."""
    reason = _model_unsupported_reason(model)
    if reason is None:
        attn = _config_of(model)._attn_implementation
        if attn not in SUPPORTED_ATTENTION:
            return f"attention implementation {attn!r}: a shared KV cache is exact (tested) under sdpa or eager only"
    return reason


def packed_unsupported_reason(model) -> str | None:
    """Why a packed forward (`shared_prefix_logps_and_entropies`, `PromptContext`, `pack_rows` for the local PyTRIO
    server) would not reproduce `model`'s plain forward exactly, or ``None`` if it would."""
    reason = _model_unsupported_reason(model)
    if reason is not None:
        return reason
    attn = _config_of(model)._attn_implementation
    if attn not in PACKED_ATTENTION:
        return f"attention implementation {attn!r} is not one of {', '.join(PACKED_ATTENTION)}"
    if attn == "flex_attention" and next(iter(model.parameters())).device.type != "cuda":
        # torch 2.13's CPU flex kernel fails to compile (C++ codegen) a mask indexed by the query once the shape
        # changes and inductor makes it dynamic; flex has no backward on CPU anyway
        return "flex_attention's CPU kernel can't compile the packed layout's mask for varying shapes (CUDA only)"
    if attn.startswith("flash_attention"):
        from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

        if flash_attn_supports_top_left_mask():
            return "flash-attn < 2.1 aligns its causal mask top-left (a row's keys start with its shared prompt)"
    return None
