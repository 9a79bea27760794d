"""Reward functions by name, so YAML recipes can say `reward_funcs: [boxed, format]`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable, Sequence

REWARD_REGISTRY: dict[str, Callable] = {}


def register_reward(name: str):
    """Decorator: make a reward function selectable by `name` in `get_reward_funcs` / YAML.

    A registered function may carry `with_context(**context) -> callable`, used by `get_reward_funcs`
    to build a variant that knows trainer settings (`max_completion_length`, `eos_token_ids`)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(func: Callable) -> Callable:
        existing = REWARD_REGISTRY.get(name)
        if existing is not None and existing is not func:
            raise ValueError(f"reward {name!r} is already registered ({existing!r})")
        REWARD_REGISTRY[name] = func
        return func

    return decorator


def unknown_reward(name, extra: Iterable[str] = (), models: bool = False, empty: bool = False) -> ValueError:
    """The one-line error of a reward name no one knows (`extra`: names built from options, e.g. ``judge``)."""
    valid = ", ".join(sorted([*REWARD_REGISTRY, *extra]))
    tail = " (or a reward model's folder or hub id)" if models else ""
    if empty:
        return ValueError(f"no reward functions given; valid: {valid}{tail}")
    close = difflib.get_close_matches(str(name), [*REWARD_REGISTRY, *extra], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown reward {name!r}{hint}; valid: {valid}{tail}")


def _unknown(name) -> ValueError:
    return unknown_reward(name)


def get_reward(name_or_func) -> Callable:
    """One reward function from its registry name (or a callable, returned as is)."""
    if callable(name_or_func):
        return name_or_func
    if not isinstance(name_or_func, str):
        raise TypeError(f"a reward is a registry name or a callable, got {type(name_or_func).__name__}")
    func = REWARD_REGISTRY.get(name_or_func.strip())
    if func is None:
        raise _unknown(name_or_func)
    return func


def get_reward_funcs(
    names: str | Iterable[str | Callable],
    max_completion_length: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> list[Callable]:
    """Reward functions for `names` (a list, or one comma-separated string), in order, ready for
    `trl.GRPOTrainer(reward_funcs=...)`. Unknown names raise a ValueError listing the valid ones.

    `max_completion_length` / `eos_token_ids` (the trainer's settings) let rewards that veto truncated
    completions (`hybrid`) recognise them from TRL's `completion_ids`; pass them when you have them."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if names is None:
        raise ValueError(f"no reward functions given; valid: {', '.join(sorted(REWARD_REGISTRY))}")
    funcs = [get_reward(n) for n in names]
    context = {"max_completion_length": max_completion_length, "eos_token_ids": eos_token_ids}
    context = {k: v for k, v in context.items() if v is not None}
    if context:
        funcs = [f.with_context(**context) if hasattr(f, "with_context") else f for f in funcs]
    if not funcs:
        raise ValueError(f"no reward functions given; valid: {', '.join(sorted(REWARD_REGISTRY))}")
    return funcs


def reward_names(entries: Iterable | None = None, func_names: Iterable[str] | None = None) -> list[tuple[str, ...]]:
    """The names each reward function answers to in the options that name one (``degenerate_reward``,
    ``curriculum_reward``; `trl_grpo_ext.grpo.spec.reward_option_problems`): its function name (TRL's
    ``rewards/<name>/mean``), the registry names of that function and its ``reward_funcs`` entry, so both spellings
    work on both paths ('boxed' and 'boxed_reward').

    `entries`: the ``reward_funcs`` list (names or callables); `func_names`: the functions' names as TRL gives them
    (`trl_grpo_ext.grpo.reward_aggregation.reward_func_name`); without them a registry entry's function name is used.
    """
    entries = list(entries) if entries is not None else None
    if func_names is None:
        func_names = [getattr(REWARD_REGISTRY.get(e, e) if isinstance(e, str) else e, "__name__", e) for e in entries]
    registry_by_function: dict[str, list[str]] = {}
    for key, func in REWARD_REGISTRY.items():
        registry_by_function.setdefault(getattr(func, "__name__", key), []).append(key)
    names = []
    for index, func_name in enumerate(func_names):
        own = [str(func_name), *registry_by_function.get(func_name, [])]
        if entries is not None and isinstance(entries[index], str):
            own.append(entries[index].strip())
        names.append(tuple(dict.fromkeys(own)))
    return names


def reward_index(name: str, names: Sequence[Collection[str]]) -> int | None:
    """Position of the reward function called `name` (`names[i]`: every name function i answers to, from
    `reward_names`); None when none is."""
    for index, own in enumerate(names):
        if name in own:
            return index
    return None
