"""The decode engine: one sampling loop for every sampler that runs in this process.

Samplers that decode with transformers in this process -- the TRL path's sampler (on-policy and asynchronous) and
`trl-grpo-ext eval` -- go through `trl_grpo_ext.prefix.shared_prefix_generate`, which calls `decode` for the loop
after the prompts are encoded. `decode` runs the engine asked for:

- ``generate``: transformers' ``model.generate``;
- ``packed``: `packed_generate` (`trl_grpo_ext.decode.engine`): the same token selection and stopping over a static
  KV cache and oneDNN-prepacked weights (`trl_grpo_ext.decode.weights`), for Llama-layout fp32 models on the CPU;
  where it does not apply (`engine_unsupported_reason`) ``generate`` decodes, and the reason is logged once.

`bench/decode.py` measures both against the machine's bound (docs/decode.md).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# the engines, importable without torch (configs validate the name before any model loads)
ENGINES = ("generate", "packed")
_logged: set[str] = set()


def check_engine(engine: str) -> str:
    """`engine` if it names one (``ValueError`` in one line otherwise)."""
    if engine not in ENGINES:
        raise ValueError(f"decode_engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine


def decode(model, engine: str, input_ids, attention_mask, cache=None, **generate_kwargs):
    """``model.generate(input_ids=..., attention_mask=..., **generate_kwargs)`` by `engine` (module docstring);
    `cache` holds every prompt token but the last (or is None)."""
    from trl_grpo_ext.compat import cache_kwargs
    from trl_grpo_ext.decode.engine import engine_unsupported_reason, packed_generate

    if check_engine(engine) == "packed":
        config = generate_kwargs.get("generation_config") or model.generation_config
        reason = engine_unsupported_reason(model, config, generate_kwargs)
        if reason is None:
            return packed_generate(
                model,
                input_ids,
                attention_mask,
                config,
                cache=cache,
                logits_processor=generate_kwargs.get("logits_processor"),
            )
        if reason not in _logged:
            _logged.add(reason)
            logger.warning("decode engine 'packed' does not apply (%s): transformers' generate decodes", reason)
    extra = cache_kwargs(model, cache) if cache is not None else {}
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **extra, **generate_kwargs)


def release_packed(model) -> None:
    """Free the packed engine's copy of `model`'s weights (`trl_grpo_ext.decode.weights.release_packed`)."""
    from trl_grpo_ext.decode.weights import release_packed as release

    release(model)


__all__ = ["ENGINES", "check_engine", "decode", "release_packed"]
