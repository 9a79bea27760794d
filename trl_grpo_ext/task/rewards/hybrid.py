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
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class _Part:
    """One weighted component: its metric label, its function, its weight, and what the function declares."""

    label: str
    func: Callable
    weight: float

    @property
    def after_vetoes(self) -> bool:  # asked about the completions no veto fired on only (a judge, a reward model)
        return _after_vetoes(self.func)

    @property
    def is_cost(self) -> bool:  # a cost per judge request: scored last, from the requests the judges sent
        return bool(getattr(self.func, "needs_judge_requests", False))

    @property
    def abstains(self) -> bool:  # its None is a missing term (a judge whose request failed), not an unscorable one
        return bool(getattr(self.func, "abstains_on_failure", False))


@dataclass
class _Batch:
    """One call's state: the completions, the components' keyword arguments, the vetoes' verdicts, the scores."""

    completions: list
    common: dict
    fired: dict[str, list[bool]]  # each veto's verdict per completion
    vetoed: list[bool]  # whether any veto fired, per completion
    scores: dict[str, list] = field(default_factory=dict)  # each component's score per completion (None: not asked)
    requests: list[int] = field(default_factory=list)  # judge requests each completion sent

    @property
    def n(self) -> int:
        return len(self.completions)


class HybridReward:
    """A TRL reward: `veto_value` if any veto fires, else ``sum(weight * component(completion))`` (see
    `make_hybrid_reward`, which builds it). A call runs four steps: the vetoes on every completion (`_start`), the
    components (a costly one on the completions no veto fired on only), the costs per judge request (`_finish`),
    and `total`, the rule that turns one completion's veto and terms into its reward."""

    def __init__(self, parts: list[_Part], vetoes, veto_value: float, name: str, max_completion_length, eos, settings):
        self.parts, self.vetoes, self.veto_value = parts, vetoes, veto_value
        self.max_completion_length, self.eos_token_ids, self.settings = max_completion_length, eos, settings
        self.__name__ = self.__qualname__ = name
        self.__doc__ = f"Hybrid reward {name}: vetoes {list(settings['vetoes'])}, components {settings['components']}."
        self.components = {part.label: part.func for part in parts}

    def total(self, vetoed: bool, terms: list[tuple[_Part, object]]) -> float | None:
        """One completion's reward from its veto and its (part, score) terms."""
        # A vetoed completion's costly components were not asked: no term, not a missing one.
        asked = [(part, v) for part, v in terms if not (vetoed and part.after_vetoes)]
        kept = [(part.weight, v) for part, v in asked if not (v is None and part.abstains)]
        if any(v is None for _, v in kept) or not (kept or vetoed):
            return None  # a component could not score it (or nothing did)
        if vetoed:
            return self.veto_value
        return sum(w * float(v) for w, v in kept)

    def __call__(self, completions, completion_ids=None, log_metric=None, **kwargs) -> list[float | None]:
        batch, calls = self._start(completions, completion_ids, log_metric, kwargs)
        for part, out, positions in calls:
            self._spread(batch, part, out, positions)
        return self._finish(batch, log_metric)

    def _start(self, completions, completion_ids, log_metric, kwargs) -> tuple[_Batch, list[tuple]]:
        """The batch with its vetoes fired, and the components' calls before the costs: (part, answers or a
        coroutine for an async component, the batch positions asked). A rule scores every completion, a costly
        component those no veto fired on (and is not called when none is left)."""
        kwargs = dict(kwargs)
        limits = {key: kwargs.pop(key, None) for key in ("max_completion_length", "eos_token_ids")}
        completions = as_list(completions)
        passthrough = {k: v for k, v in kwargs.items() if k not in _TRL_CALLBACKS}
        common = {**passthrough, "completion_ids": completion_ids, "log_metric": log_metric}
        fired, vetoed = self._fire_vetoes(completions, completion_ids, limits)
        batch = _Batch(completions, common, fired, vetoed, requests=[0] * len(completions))
        keep = [i for i in range(batch.n) if not vetoed[i]]
        calls = []
        for part in (p for p in self.parts if not p.is_cost):
            if not part.after_vetoes:
                calls.append((part, part.func(completions, **common), list(range(batch.n))))
            elif keep:
                asked = [completions[i] for i in keep]
                calls.append((part, part.func(asked, **_kept_columns(common, keep, batch.n)), keep))
            else:
                batch.scores[part.label] = [None] * batch.n
        return batch, calls

    def _fire_vetoes(self, completions, completion_ids, limits) -> tuple[dict[str, list[bool]], list[bool]]:
        """(each veto's verdict per completion, whether any fired per completion); a veto that raises does not fire."""
        n = len(completions)
        texts = [completion_text(c) for c in completions]
        ids = column(completion_ids, n, "completion_ids") if completion_ids is not None else [None] * n
        context = dict(
            max_completion_length=limits["max_completion_length"] or self.max_completion_length,
            eos_token_ids=limits["eos_token_ids"] or self.eos_token_ids,
        )
        fired = {
            label: [
                bool(safe_score(veto, texts[i], default=False, completion_ids=ids[i], **context)) for i in range(n)
            ]
            for label, veto in self.vetoes
        }
        return fired, [any(fired[label][i] for label, _ in self.vetoes) for i in range(n)]

    @staticmethod
    def _spread(batch: _Batch, part: _Part, out, positions: list[int]) -> None:
        """A component's answers put back in the batch's positions, with the judge requests each one sent."""
        out = _checked(part.label, out, len(positions))
        batch.scores[part.label] = [None] * batch.n
        for j, i in enumerate(positions):
            batch.scores[part.label][i] = out[j]
        for j, sent in enumerate(getattr(part.func, "last_requests", None) or []):
            batch.requests[positions[j]] += sent

    def _finish(self, batch: _Batch, log_metric) -> list[float | None]:
        """The costs (after the judges whose requests they count), each completion's `total`, the metrics."""
        for part in (p for p in self.parts if p.is_cost):
            out = part.func(batch.completions, judge_requests=batch.requests, **batch.common)
            batch.scores[part.label] = _checked(part.label, out, batch.n)
        rewards = [
            self.total(batch.vetoed[i], [(part, batch.scores[part.label][i]) for part in self.parts])
            for i in range(batch.n)
        ]
        if callable(log_metric) and batch.n:
            prefix = f"rewards/{self.__name__}"
            for part in self.parts:
                valid = [float(v) for v in batch.scores[part.label] if v is not None]
                if valid:
                    log_metric(f"{prefix}/{part.label}", sum(valid) / len(valid))
            for label, _ in self.vetoes:
                log_metric(f"{prefix}/veto_{label}", sum(batch.fired[label]) / batch.n)
            log_metric(f"{prefix}/vetoed", sum(batch.vetoed) / batch.n)
        return rewards

    def with_context(self, **context) -> HybridReward:
        """The same hybrid with `max_completion_length` / `eos_token_ids` (TRL's, for the `truncated` veto) set."""
        current = {"max_completion_length": self.max_completion_length, "eos_token_ids": self.eos_token_ids}
        return make_hybrid_reward(**{**self.settings, **current, **context})

    def preflight(self) -> None:
        for part in self.parts:
            if hasattr(part.func, "preflight"):
                part.func.preflight()


class AsyncHybridReward(HybridReward):
    """`HybridReward` with an async component (the judge): async too, as TRL expects; the async components' calls
    run concurrently."""

    async def __call__(self, completions, completion_ids=None, log_metric=None, **kwargs) -> list[float | None]:
        batch, calls = self._start(completions, completion_ids, log_metric, kwargs)
        outputs = iter(await asyncio.gather(*(out for part, out, _ in calls if _is_async(part.func))))
        for part, out, positions in calls:
            self._spread(batch, part, next(outputs) if _is_async(part.func) else out, positions)
        return self._finish(batch, log_metric)


def _checked(label: str, out, n: int) -> list:
    out = list(out)
    if len(out) != n:
        raise ValueError(f"component {label!r} returned {len(out)} rewards for {n} completions")
    return out


def make_hybrid_reward(
    components: Mapping[str | Callable, float],
    vetoes: Iterable[str | Callable] = DEFAULT_VETOES,
    veto_value: float = 0.0,
    name: str = "hybrid_reward",
    max_completion_length: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
    resolve: Callable[[str | Callable], Callable] = get_reward,
) -> HybridReward:
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
        parts.append(_Part(key if isinstance(key, str) else _callable_name(func), func, weight))
    if any(p.is_cost for p in parts) and not any(hasattr(p.func, "last_requests") for p in parts):
        raise ValueError(f"{name}: a cost per judge call needs a judge component beside it")
    settings = dict(components=dict(components), vetoes=tuple(vetoes or ()), veto_value=float(veto_value), name=name)
    settings["resolve"] = resolve
    cls = AsyncHybridReward if any(_is_async(p.func) for p in parts) else HybridReward
    eos = list(eos_token_ids) if eos_token_ids is not None else None
    return cls(parts, _resolve_vetoes(vetoes), float(veto_value), name, max_completion_length, eos, settings)


DEFAULT_HYBRID_COMPONENTS = {"boxed": 1.0, "format": 0.3}

hybrid_reward = register_reward("hybrid")(make_hybrid_reward(DEFAULT_HYBRID_COMPONENTS, name="hybrid_reward"))
