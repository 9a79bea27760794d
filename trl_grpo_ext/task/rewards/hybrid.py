"""`make_hybrid_reward`: hard vetoes first, then a weighted sum of component rewards ("type D").

A vetoed completion scores `veto_value` whatever its components say, so it cannot buy back points
with format credit. The vetoes run first in time too: a costly component (a component with
``scored_after_vetoes``: the judge, a reward model) is asked about the completions no veto fired on only,
so a vetoed completion costs no judge request and no reward-model forward; the rules score every completion.
Per-component means and veto rates go to TRL's `log_metric` callback
(`rewards/<name>/<component>`, `rewards/<name>/veto_<veto>`, `rewards/<name>/vetoed`), so a run shows
why its reward moved; a costly component's mean is over the completions it was asked about.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Iterable, Mapping

from trl_grpo_ext.task.answers import completion_text
from trl_grpo_ext.task.rewards import accuracy as _accuracy  # noqa: F401 - registers `boxed`
from trl_grpo_ext.task.rewards import format as _format  # noqa: F401 - registers `format`
from trl_grpo_ext.task.rewards._batch import as_list, column, safe_score
from trl_grpo_ext.task.rewards.registry import get_reward, register_reward
from trl_grpo_ext.task.rewards.vetoes import DEFAULT_VETOES, VETOES

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


def _after_vetoes(func) -> bool:
    """Whether `func` is asked about the completions no veto fired on only (the judge, a reward model: a request or
    a forward each, spent for nothing on a completion the veto scores anyway). A callable of the user's opts in by
    setting the attribute."""
    return bool(getattr(func, "scored_after_vetoes", False))


def _kept_columns(kwargs: Mapping, keep: list[int], n: int) -> dict:
    """TRL's per-completion columns (lists of `n` values: prompts, completion_ids, dataset columns) cut to the
    completions in `keep`; everything else (trainer_state, callbacks) passed as it is."""
    return {k: [v[i] for i in keep] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}


def _is_async(func) -> bool:
    """TRL's test (`trl.trainer.utils.is_async_callable`, without importing trl): a coroutine function or an object
    whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def make_hybrid_reward(
    components: Mapping[str | Callable, float],
    vetoes: Iterable[str | Callable] = DEFAULT_VETOES,
    veto_value: float = 0.0,
    name: str = "hybrid_reward",
    max_completion_length: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
    resolve: Callable[[str | Callable], Callable] = get_reward,
) -> Callable:
    """A reward: `veto_value` if any veto fires, else `sum(weight * component(completion))`.

    `components` maps registry names (`"boxed"`, `"format"`, ...) or reward callables to weights; `resolve` turns a
    name into its function (`trl_grpo_ext.task.rewards.build` passes one that also knows `judge`, `cost` and reward
    models). `vetoes` are names from `trl_grpo_ext.task.rewards.vetoes.VETOES` (`no_box`, `conflicting_boxes`,
    `repetition`, `truncated`) or callables `f(text, *, completion_ids, max_completion_length,
    eos_token_ids, **_) -> bool`. The `truncated` veto uses TRL's `completion_ids` together with
    `max_completion_length` and/or `eos_token_ids`, given here or as call kwargs.
    A component that scores None (unparseable ground truth) makes the hybrid score None, except a component that
    abstains on failure (the judge, whose request failed): its term is left out, as TRL leaves a NaN reward out of
    the weighted sum. Components with ``scored_after_vetoes`` (the judge, a reward model) are called with the
    completions no veto fired on only (and not at all when every one was vetoed); a pairwise judge then compares
    those among themselves. With an async component (the judge) the hybrid is async too, as TRL expects; a `cost`
    component per judge call reads the requests the judge components sent."""
    if not components:
        raise ValueError("make_hybrid_reward needs at least one component, e.g. {'boxed': 1.0}")
    parts = []
    for key, weight in components.items():
        func = resolve(key)
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"weight of {key!r} must be finite, got {weight}")
        parts.append((key if isinstance(key, str) else _callable_name(func), func, weight))
    if any(getattr(f, "needs_judge_requests", False) for _, f, _ in parts) and not any(
        hasattr(f, "last_requests") for _, f, _ in parts
    ):
        raise ValueError(f"{name}: a cost per judge call needs a judge component beside it")
    veto_list = _resolve_vetoes(vetoes)
    veto_value = float(veto_value)
    eos_default = list(eos_token_ids) if eos_token_ids is not None else None
    settings = dict(components=dict(components), vetoes=tuple(vetoes or ()), veto_value=veto_value, name=name)
    settings["resolve"] = resolve
    first = [p for p in parts if not getattr(p[1], "needs_judge_requests", False)]
    last = [p for p in parts if getattr(p[1], "needs_judge_requests", False)]  # after the judges they count

    def call_kwargs(completions, completion_ids, log_metric, kwargs):
        passthrough = {k: v for k, v in kwargs.items() if k not in _TRL_CALLBACKS}
        return {**passthrough, "completion_ids": completion_ids, "log_metric": log_metric}

    def check(label, out, n) -> list:
        out = list(out)
        if len(out) != n:
            raise ValueError(f"component {label!r} returned {len(out)} rewards for {n} completions")
        return out

    def fire_vetoes(completions, completion_ids, limits) -> tuple[dict[str, list[bool]], list[bool]]:
        """(each veto's verdict per completion, whether any veto fired per completion); a veto that raises does
        not fire."""
        n = len(completions)
        texts = [completion_text(c) for c in completions]
        ids = column(completion_ids, n, "completion_ids") if completion_ids is not None else [None] * n
        limit = limits.get("max_completion_length") or max_completion_length
        eos = limits.get("eos_token_ids") or eos_default
        fired = {
            label: [
                bool(
                    safe_score(
                        veto,
                        texts[i],
                        default=False,
                        completion_ids=ids[i],
                        max_completion_length=limit,
                        eos_token_ids=eos,
                    )
                )
                for i in range(n)
            ]
            for label, veto in veto_list
        }
        return fired, [any(fired[label][i] for label, _ in veto_list) for i in range(n)]

    def start_calls(completions, common, vetoed, scores) -> list[tuple]:
        """(label, func, answers or a coroutine for an async func, the batch positions asked) per component before
        the costs: a rule on every completion, a costly component on those no veto fired on (not called when none
        is left). `spread` puts each component's answers back in the batch's positions."""
        n = len(completions)
        keep = [i for i in range(n) if not vetoed[i]]
        calls = []
        for label, func, _ in first:
            if not _after_vetoes(func):
                calls.append((label, func, func(completions, **common), list(range(n))))
            elif keep:
                asked = [completions[i] for i in keep]
                calls.append((label, func, func(asked, **_kept_columns(common, keep, n)), keep))
            else:
                scores[label] = [None] * n
        return calls

    def spread(label, out, positions, n, scores, requests, func) -> None:
        out = check(label, out, len(positions))
        scores[label] = [None] * n
        for j, i in enumerate(positions):
            scores[label][i] = out[j]
        for j, sent in enumerate(getattr(func, "last_requests", None) or []):  # what each completion sent
            requests[positions[j]] += sent

    def add_costs(scores, completions, common, requests) -> None:
        for label, func, _ in last:
            scores[label] = check(label, func(completions, judge_requests=requests, **common), len(completions))

    def combine(n, log_metric, fired, vetoed, scores) -> list[float | None]:
        rewards: list[float | None] = []
        for i in range(n):
            # A vetoed completion's costly components were not asked: no term, not a missing one.
            asked = [
                (func, w, scores[label][i]) for label, func, w in parts if not (vetoed[i] and _after_vetoes(func))
            ]
            kept = [(w, v) for func, w, v in asked if not (v is None and getattr(func, "abstains_on_failure", False))]
            if any(v is None for _, v in kept) or not (kept or vetoed[i]):
                rewards.append(None)
            elif vetoed[i]:
                rewards.append(veto_value)
            else:
                rewards.append(sum(w * float(v) for w, v in kept))

        if callable(log_metric) and n:
            prefix = f"rewards/{name}"
            for label, _, _ in parts:
                valid = [float(v) for v in scores[label] if v is not None]
                if valid:
                    log_metric(f"{prefix}/{label}", sum(valid) / len(valid))
            for label, _ in veto_list:
                log_metric(f"{prefix}/veto_{label}", sum(fired[label]) / n)
            log_metric(f"{prefix}/vetoed", sum(vetoed) / n)
        return rewards

    def prepare(completions, kwargs):
        kwargs = dict(kwargs)
        limit = kwargs.pop("max_completion_length", None)
        eos = kwargs.pop("eos_token_ids", None)
        return as_list(completions), kwargs, {"max_completion_length": limit, "eos_token_ids": eos}

    if any(_is_async(f) for _, f, _ in parts):

        async def reward(completions, completion_ids=None, log_metric=None, **kwargs) -> list[float | None]:
            completions, kwargs, limits = prepare(completions, kwargs)
            common = call_kwargs(completions, completion_ids, log_metric, kwargs)
            n = len(completions)
            fired, vetoed = fire_vetoes(completions, completion_ids, limits)
            scores, requests = {}, [0] * n
            calls = start_calls(completions, common, vetoed, scores)
            outputs = iter(await asyncio.gather(*(out for _, f, out, _ in calls if _is_async(f))))
            for label, f, out, positions in calls:
                spread(label, next(outputs) if _is_async(f) else out, positions, n, scores, requests, f)
            add_costs(scores, completions, common, requests)
            return combine(n, log_metric, fired, vetoed, scores)

    else:

        def reward(completions, completion_ids=None, log_metric=None, **kwargs) -> list[float | None]:
            completions, kwargs, limits = prepare(completions, kwargs)
            common = call_kwargs(completions, completion_ids, log_metric, kwargs)
            n = len(completions)
            fired, vetoed = fire_vetoes(completions, completion_ids, limits)
            scores, requests = {}, [0] * n
            for label, f, out, positions in start_calls(completions, common, vetoed, scores):
                spread(label, out, positions, n, scores, requests, f)
            add_costs(scores, completions, common, requests)
            return combine(n, log_metric, fired, vetoed, scores)

    def with_context(**context) -> Callable:
        return make_hybrid_reward(
            **{**settings, "max_completion_length": max_completion_length, "eos_token_ids": eos_default, **context}
        )

    def preflight() -> None:
        for _, func, _ in parts:
            if hasattr(func, "preflight"):
                func.preflight()

    reward.__name__ = name
    reward.__qualname__ = name
    reward.__doc__ = f"Hybrid reward {name}: vetoes {list(settings['vetoes'])}, components {settings['components']}."
    reward.with_context = with_context
    reward.preflight = preflight
    reward.settings = settings
    reward.components = {label: func for label, func, _ in parts}
    return reward


DEFAULT_HYBRID_COMPONENTS = {"boxed": 1.0, "format": 0.3}

hybrid_reward = register_reward("hybrid")(make_hybrid_reward(DEFAULT_HYBRID_COMPONENTS, name="hybrid_reward"))
