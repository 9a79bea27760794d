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


@functools.cache
def _takes_keyword(function, keyword: str) -> bool:
    return keyword in inspect.signature(function).parameters


def set_active_adapter(peft_model, name: str, trainable: bool) -> None:
    """Make `name` the active adapter of a `peft.PeftModel`, its weights trainable or frozen.

    Newer peft (0.21 does) takes ``set_adapter(name, inference_mode=...)``; older (0.18 does not), whose
    ``set_adapter`` always makes the adapter trainable, gets it frozen afterwards, as the newer call does.
    """
    if _takes_keyword(type(peft_model).set_adapter, "inference_mode"):
        peft_model.set_adapter(name, inference_mode=not trainable)
        return
    peft_model.set_adapter(name)
    if not trainable:
        peft_model.set_requires_grad(name, requires_grad=False)


def merge_and_unload(peft_model):
    """The base model with the adapter merged into its weights, as a plain transformers model.

    Newer peft (0.21 does) removes the base model's ``peft_config`` attribute once every adapter layer is gone; older
    (0.18) leaves it (a later `get_peft_model` then warns of several adapters, and code asking "is this a PEFT
    model?", like the eval cache's `live_model_identity`, says yes).
    """
    model = peft_model.merge_and_unload()
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model
