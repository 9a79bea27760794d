"""Adaptive curriculum over a task mix: each task's weight follows its running pass rate.

A prompt group teaches GRPO something only if some completions pass and some fail. A task the model always
solves (pass rate ~1) or never solves (~0) yields degenerate groups, so its weight shrinks; tasks near 50 % grow:

    weight_t ∝ base_t * (p_t * (1 - p_t) + floor)

``base_t`` is the task's share of the mix (of the training rows), ``p_t`` an exponential moving average of the
task's pass rate (a completion passes when its reward reaches a threshold), updated once per generation batch
with ``p_t <- (1 - ema) * p_t + ema * batch_pass_rate_t`` for the tasks that batch held; every task starts at
``prior``. ``floor`` keeps every task in the mix, so a task whose pass rate moves is noticed again.
Deterministic: the weights are a function of the observed (task, passed) pairs in order; the samplers draw from
seeded `random.Random` streams, never from the clock or thread timing.

Used by the TRL trainer (`trl_grpo_ext.trl.sampling`: `CurriculumMixin` with `CurriculumSampler`, a torch
sampler) and the PyTRIO loop (`CurriculumPromptStream`). No torch here: configs and the PyTRIO loop import this
module without loading it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

DEFAULT_EMA = 0.3
DEFAULT_FLOOR = 0.05
DEFAULT_PRIOR = 0.5


class Curriculum:
    """Task weights from running pass rates (see the module docstring for the rule).

    ``base_weights``: {task: share} of the mix (normalised here). ``ema`` in (0, 1], ``floor`` > 0, ``prior`` in
    [0, 1]. `update` takes one generation batch's per-completion tasks and pass values.
    """

    def __init__(self, base_weights: dict[str, float], ema=DEFAULT_EMA, floor=DEFAULT_FLOOR, prior=DEFAULT_PRIOR):
        if not base_weights:
            raise ValueError("a curriculum needs at least one task")
        if any(not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0) for w in base_weights.values()):
            raise ValueError(f"task weights must be finite numbers > 0, got {base_weights}")
        check_curriculum_settings(ema, floor, prior)
        total = float(sum(base_weights.values()))
        self.base = {task: float(w) / total for task, w in base_weights.items()}
        self.ema, self.floor, self.prior = float(ema), float(floor), float(prior)
        self.pass_rates = dict.fromkeys(self.base, self.prior)
        self.updates = 0

    @property
    def tasks(self) -> list[str]:
        return list(self.base)

    def update(self, tasks: Sequence[str], passed: Sequence[float | None]) -> None:
        """Fold one generation batch in: ``tasks[i]`` and ``passed[i]`` (1/0, or a fraction; None / NaN: unscored,
        ignored) per completion. Tasks outside the curriculum are an error (the data and the mix disagree)."""
        if len(tasks) != len(passed):
            raise ValueError(f"{len(tasks)} tasks for {len(passed)} pass values")
        sums: dict[str, list[float]] = {}
        for task, value in zip(tasks, passed, strict=True):
            if task not in self.base:
                raise ValueError(f"task {task!r} is not in the curriculum ({', '.join(self.base)})")
            if value is None or math.isnan(float(value)):
                continue
            acc = sums.setdefault(task, [0.0, 0])
            acc[0] += float(value)
            acc[1] += 1
        for task in self.base:  # fixed order: same floats whatever order the batch listed its tasks in
            if task in sums:
                rate = sums[task][0] / sums[task][1]
                self.pass_rates[task] = (1.0 - self.ema) * self.pass_rates[task] + self.ema * rate
        self.updates += 1

    def weights(self) -> dict[str, float]:
        raw = {t: self.base[t] * (p * (1.0 - p) + self.floor) for t, p in self.pass_rates.items()}
        total = sum(raw.values())
        return {t: w / total for t, w in raw.items()}

    def metrics(self) -> dict[str, float]:
        """``curriculum/<task>/weight`` and ``curriculum/<task>/pass_rate`` (the running estimate)."""
        out = {}
        for task, weight in self.weights().items():
            out[f"curriculum/{task}/weight"] = weight
            out[f"curriculum/{task}/pass_rate"] = self.pass_rates[task]
        return out

    def state_dict(self) -> dict:
        return {"pass_rates": dict(self.pass_rates), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        rates = state["pass_rates"]
        if set(rates) != set(self.base):
            raise ValueError(f"curriculum state has tasks {sorted(rates)}, this run {sorted(self.base)}")
        self.pass_rates = {t: float(rates[t]) for t in self.base}
        self.updates = int(state.get("updates", 0))


def curriculum_settings_problems(ema, floor, prior) -> list[str]:
    """One-line messages for each bad number of the three (config validation reports them with the others)."""
    problems = []
    if not (isinstance(ema, (int, float)) and 0 < ema <= 1):
        problems.append(f"curriculum_ema={ema!r} must be in (0, 1]")
    if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor > 0):
        problems.append(f"curriculum_floor={floor!r} must be a finite number > 0 (it keeps every task in the mix)")
    if not (isinstance(prior, (int, float)) and 0 <= prior <= 1):
        problems.append(f"curriculum prior={prior!r} must be in [0, 1]")
    return problems


def check_curriculum_settings(ema, floor, prior) -> None:
    """`curriculum_settings_problems` as one ValueError."""
    problems = curriculum_settings_problems(ema, floor, prior)
    if problems:
        raise ValueError("; ".join(problems))


def passed_values(rewards: Sequence[float], threshold: float) -> list[float]:
    """1.0 where a completion's reward reaches ``threshold``, 0.0 below it, NaN where it is unscored (NaN)."""
    return [math.nan if math.isnan(r) else float(r >= threshold) for r in rewards]


def curriculum_from_tasks(tasks: Sequence[str], **settings) -> Curriculum:
    """A `Curriculum` whose base weights are the tasks' shares of ``tasks`` (the training rows' task column), in
    order of first appearance."""
    counts: dict[str, int] = {}
    for task in tasks:
        if not isinstance(task, str) or not task:
            raise ValueError(f"every training row needs a task name for the curriculum, got {task!r}")
        counts[task] = counts.get(task, 0) + 1
    return Curriculum(counts, **settings)


class TaskPools:
    """Per task, the row indices in a seeded order, reshuffled each time a task's rows are used up."""

    def __init__(self, tasks: Sequence[str], rng: random.Random):
        self._rng = rng
        self._rows: dict[str, list[int]] = {}
        for index, task in enumerate(tasks):
            self._rows.setdefault(task, []).append(index)
        self._order: dict[str, list[int]] = {}
        self._cursor: dict[str, int] = {}

    def available(self) -> set[str]:
        return set(self._rows)

    def next(self, task: str) -> int:
        order, cursor = self._order.get(task), self._cursor.get(task, 0)
        if order is None or cursor >= len(order):
            order = list(self._rows[task])
            self._rng.shuffle(order)
            self._order[task], cursor = order, 0
        self._cursor[task] = cursor + 1
        return order[cursor]


def draw_tasks(curriculum: Curriculum, available: set[str], n: int, rng: random.Random) -> list[str]:
    weights = curriculum.weights()
    names = [t for t in curriculum.tasks if t in available]
    return rng.choices(names, [weights[t] for t in names], k=n)


class CurriculumPromptStream:
    """The PyTRIO loop's prompt stream (`trl_grpo_ext.pytrio.prompts.PromptStream`'s interface: ``take(n)``,
    ``position``) with each prompt's task drawn from the curriculum's current weights. ``rows`` carry ``task``.

    ``position`` counts prompts handed out; a stream rebuilt at a position (a resumed run, whose loop state restored
    the pass rates) replays that many draws with the weights it is given, so its later prompts differ from an
    uninterrupted run's, deterministically."""

    def __init__(self, rows: list[dict], curriculum: Curriculum, seed: int, position: int = 0):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.curriculum = curriculum
        self.position = 0
        tasks = [row.get("task") for row in rows]
        unknown = sorted({str(t) for t in tasks} - set(curriculum.tasks))
        if unknown:
            raise ValueError(f"training rows with tasks {unknown} are not in the curriculum")
        self._rng = random.Random(f"curriculum-stream-{seed}")
        self._pools = TaskPools(tasks, random.Random(f"curriculum-rows-{seed}"))
        if position:
            self.take(position)

    def take(self, n: int) -> list[dict]:
        tasks = draw_tasks(self.curriculum, self._pools.available(), n, self._rng)
        self.position += n
        return [self.rows[self._pools.next(task)] for task in tasks]
