"""`make_hybrid_reward`: hard vetoes first, then a weighted sum of component rewards ("type D").

A vetoed completion scores `veto_value` whatever its components say, so it cannot buy back points
with format credit. Per-component means and veto rates go to TRL's `log_metric` callback
(`rewards/<name>/<component>`, `rewards/<name>/veto_<veto>`, `rewards/<name>/vetoed`), so a run shows
why its reward moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from ..answers import completion_text
from . import accuracy as _accuracy  # noqa: F401 - registers `boxed`
from . import format as _format  # noqa: F401 - registers `format`
from ._batch import as_list, column, safe_score
from .registry import get_reward, register_reward
from .vetoes import DEFAULT_VETOES, VETOES

_TRL_CALLBACKS = ("log_metric", "log_extra")


def _callable_name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _resolve_vetoes(vetoes) -> list[tuple[str, Callable[..., bool]]]:
    resolved = []
    for v in vetoes or ():
        if callable(v):
            resolved.append((_callable_name(v), v))
        elif v in VETOES:
            resolved.append((v, VETOES[v]))
        else:
            raise ValueError(f"unknown veto {v!r}; valid: {', '.join(sorted(VETOES))} (or a callable)")
    return resolved


def make_hybrid_reward(
    components: Mapping[str | Callable, float],
    vetoes: Iterable[str | Callable] = DEFAULT_VETOES,
    veto_value: float = 0.0,
    name: str = "hybrid_reward",
    max_completion_length: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> Callable:
    """A reward: `veto_value` if any veto fires, else `sum(weight * component(completion))`.

    `components` maps registry names (`"boxed"`, `"format"`, ...) or reward callables to weights.
    `vetoes` are names from `trl_grpo_ext.rewards.vetoes.VETOES` (`no_box`, `conflicting_boxes`,
    `repetition`, `truncated`) or callables `f(text, *, completion_ids, max_completion_length,
    eos_token_ids, **_) -> bool`. The `truncated` veto uses TRL's `completion_ids` together with
    `max_completion_length` and/or `eos_token_ids`, given here or as call kwargs.
    A component that scores None (unparseable ground truth) makes the hybrid score None."""
    if not components:
        raise ValueError("make_hybrid_reward needs at least one component, e.g. {'boxed': 1.0}")
    parts = []
    for key, weight in components.items():
        func = get_reward(key)
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"weight of {key!r} must be finite, got {weight}")
        parts.append((key if isinstance(key, str) else _callable_name(func), func, weight))
    veto_list = _resolve_vetoes(vetoes)
    veto_value = float(veto_value)
    eos_default = list(eos_token_ids) if eos_token_ids is not None else None
    settings = dict(components=dict(components), vetoes=tuple(vetoes or ()), veto_value=veto_value, name=name)

    def reward(completions, completion_ids=None, log_metric=None, **kwargs) -> list[float | None]:
        completions = as_list(completions)
        n = len(completions)
        texts = [completion_text(c) for c in completions]
        ids = column(completion_ids, n, "completion_ids") if completion_ids is not None else [None] * n
        limit = kwargs.pop("max_completion_length", None) or max_completion_length
        eos = kwargs.pop("eos_token_ids", None) or eos_default
        passthrough = {k: v for k, v in kwargs.items() if k not in _TRL_CALLBACKS}

        scores = {}
        for label, func, _ in parts:
            out = func(completions, completion_ids=completion_ids, **passthrough)
            scores[label] = list(out)
            if len(scores[label]) != n:
                raise ValueError(f"component {label!r} returned {len(scores[label])} rewards for {n} completions")

        fired = {label: [False] * n for label, _ in veto_list}
        rewards: list[float | None] = []
        for i in range(n):
            for label, veto in veto_list:
                fired[label][i] = bool(
                    safe_score(
                        veto,
                        texts[i],
                        default=False,
                        completion_ids=ids[i],
                        max_completion_length=limit,
                        eos_token_ids=eos,
                    )
                )
            values = [scores[label][i] for label, _, _ in parts]
            if any(v is None for v in values):
                rewards.append(None)
            elif any(fired[label][i] for label, _ in veto_list):
                rewards.append(veto_value)
            else:
                rewards.append(sum(w * float(v) for (_, _, w), v in zip(parts, values, strict=True)))

        if callable(log_metric) and n:
            prefix = f"rewards/{name}"
            for label, _, _ in parts:
                valid = [float(v) for v in scores[label] if v is not None]
                if valid:
                    log_metric(f"{prefix}/{label}", sum(valid) / len(valid))
            for label, _ in veto_list:
                log_metric(f"{prefix}/veto_{label}", sum(fired[label]) / n)
            vetoed = [any(fired[label][i] for label, _ in veto_list) for i in range(n)]
            log_metric(f"{prefix}/vetoed", sum(vetoed) / n)
        return rewards

    def with_context(**context) -> Callable:
        return make_hybrid_reward(
            **{**settings, "max_completion_length": max_completion_length, "eos_token_ids": eos_default, **context}
        )

    reward.__name__ = name
    reward.__qualname__ = name
    reward.__doc__ = f"Hybrid reward {name}: vetoes {list(settings['vetoes'])}, components {settings['components']}."
    reward.with_context = with_context
    reward.settings = settings
    return reward


DEFAULT_HYBRID_COMPONENTS = {"boxed": 1.0, "format": 0.3}

hybrid_reward = register_reward("hybrid")(make_hybrid_reward(DEFAULT_HYBRID_COMPONENTS, name="hybrid_reward"))
