"""When sharing is exact for a model (`sharing_unsupported_reason`), and the once-per-process log of why not."""

from __future__ import annotations

import logging

# the package's name, as when this was the one module `trl_grpo_ext/prefix.py` (log filters and tests use it)
logger = logging.getLogger(__package__)

# Attention implementations that take a custom 4D mask as given (bool for sdpa, additive float for eager).
SUPPORTED_ATTENTION = ("sdpa", "eager")
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


def sharing_unsupported_reason(model) -> str | None:
    """Why a packed/shared forward would not reproduce `model`'s plain forward exactly, or ``None`` if it would."""
    config = _config_of(model)
    if config is None:
        return f"{type(model).__name__} has no config"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        return f"attention implementation {attn!r} does not take a custom 4D mask (use sdpa or eager)"
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
