"""Calls whose spelling differs between the library versions the package supports, in one place.

Each helper detects the feature (a keyword in a signature, an attribute), never a version string, so a backport or
a patched build gets the right call too.
"""

from __future__ import annotations

import functools
import inspect


def _base_model(model):
    """The transformers model under PEFT / accelerate wrappers (their ``forward`` takes ``**kwargs``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):  # DDP / DeepSpeed engine
            model = model.module
    return model


@functools.cache
def _cache_keyword_of(model_cls: type) -> str:
    # transformers 5.24 renamed the forward/generate keyword `past_key_values` to `cache` (old name deprecated)
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def cache_keyword(model) -> str:
    """The keyword `model.forward` / `model.generate` take a KV cache under: ``cache`` or ``past_key_values``."""
    return _cache_keyword_of(type(_base_model(model)))


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for `model`'s forward or generate call."""
    return {cache_keyword(model): cache}


def output_cache(output):
    """The KV cache a forward returned, whichever attribute this transformers names it."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
