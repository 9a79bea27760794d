"""Reward functions from a recipe's ``reward_funcs`` and reward options, as both execution paths build them.

An entry is, in this order: a configured reward (``judge``, ``cost``, or ``hybrid`` with a ``hybrid:`` mapping), a
registry name (``boxed``, ``format``, ``hybrid``, ...), or a model folder / hub id (a reward model, as in TRL). The
same resolution makes the components of a configured hybrid, so a hybrid can weigh a judge, a reward model and a
cost beside the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from trl_grpo_ext.task.rewards.cost import cost_options, make_cost_reward
from trl_grpo_ext.task.rewards.hybrid import DEFAULT_HYBRID_COMPONENTS, make_hybrid_reward
from trl_grpo_ext.task.rewards.judge import make_judge_reward
from trl_grpo_ext.task.rewards.judge_config import JudgeConfig
from trl_grpo_ext.task.rewards.registry import REWARD_REGISTRY, get_reward, unknown_reward
from trl_grpo_ext.task.rewards.reward_model import (
    RewardModelOptions,
    RewardModelReward,
    is_model_entry,
    mapping_option,
)
from trl_grpo_ext.task.rewards.vetoes import DEFAULT_VETOES

# Rewards built from the recipe's options rather than found in the registry.
CONFIGURED_REWARDS = ("judge", "cost")
_HYBRID_KEYS = ("components", "vetoes", "veto_value")


def hybrid_options(value) -> dict:
    """The ``hybrid:`` mapping, checked: components (name -> weight), vetoes, veto_value."""
    mapping = mapping_option("hybrid", value)
    unknown = sorted(set(mapping) - set(_HYBRID_KEYS))
    if unknown:
        raise ValueError(f"hybrid: unknown key(s) {unknown}; valid: {list(_HYBRID_KEYS)}")
    components = mapping.get("components", DEFAULT_HYBRID_COMPONENTS)
    if not isinstance(components, dict) or not components:
        raise ValueError("hybrid.components must map reward names to weights, e.g. {boxed: 0.7, judge: 0.3}")
    vetoes = mapping.get("vetoes", list(DEFAULT_VETOES))
    if not isinstance(vetoes, (list, tuple)):
        raise ValueError(f"hybrid.vetoes must be a list of veto names, got {vetoes!r}")
    return {"components": dict(components), "vetoes": list(vetoes), "veto_value": mapping.get("veto_value", 0.0)}


class _Builder:
    """Resolves entries with one run's context (length limit, EOS, chat-template kwargs) and reward options."""

    def __init__(self, settings, max_completion_length=None, eos_token_ids=None, chat_template_kwargs=None):
        self.settings = settings
        self.context = {"max_completion_length": max_completion_length, "eos_token_ids": eos_token_ids}
        self.context = {k: v for k, v in self.context.items() if v is not None}
        self.chat_template_kwargs = chat_template_kwargs

    def option(self, name):
        return getattr(self.settings, name, None) if self.settings is not None else None

    def __call__(self, entry) -> Callable:
        if callable(entry):
            return entry.with_context(**self.context) if self.context and hasattr(entry, "with_context") else entry
        if not isinstance(entry, str):
            raise TypeError(f"a reward is a registry name or a callable, got {type(entry).__name__}")
        name = entry.strip()
        if name == "judge":
            return make_judge_reward(self.option("judge"))
        if name == "cost":
            return make_cost_reward(self.option("cost"), self.context.get("max_completion_length"))
        if name == "hybrid" and self.option("hybrid") is not None:
            return make_hybrid_reward(**hybrid_options(self.option("hybrid")), **self.context, resolve=self)
        if name in REWARD_REGISTRY:
            return self(get_reward(name))
        if is_model_entry(name):
            options = RewardModelOptions.from_mapping(self.option("reward_model"))
            return RewardModelReward(name, options, self.chat_template_kwargs)
        raise unknown_reward(name, extra=CONFIGURED_REWARDS, models=True)


def reward_functions(names: Iterable, training_args=None, tokenizer=None, settings=None) -> list[Callable]:
    """The reward functions of ``reward_funcs`` entries, ready for `trl.GRPOTrainer(reward_funcs=...)` (a reward
    model stays a `RewardModelReward`; `trl_grpo_ext.task.rewards.reward_model.trl_reward_inputs` hands it to TRL).

    `training_args` gives the length limit (``max_completion_length``) and ``chat_template_kwargs``, the tokenizer
    its EOS, so `hybrid` vetoes truncated completions and reward models render chats as TRL does; `settings` holds
    the reward options (`trl_grpo_ext.task.rewards.settings.RewardSettings`). A bad entry or option raises a one-line
    ValueError; no weights load and no server is asked (`preflight_rewards` asks the judges)."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    names = list(names or [])
    if not names:
        raise unknown_reward(None, extra=CONFIGURED_REWARDS, models=True, empty=True)
    eos = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else None
    builder = _Builder(
        settings,
        getattr(training_args, "max_completion_length", None),
        eos,
        getattr(training_args, "chat_template_kwargs", None),
    )
    return [builder(name) for name in names]


def preflight_rewards(funcs) -> None:
    """Ask every judge among `funcs` (hybrid components too) whether it is reachable: a one-line ValueError naming
    its URL if not. Both paths call this before any model loads or any file is written."""
    for func in funcs:
        check = getattr(func, "preflight", None)
        if callable(check):
            check()


def settings_problems(settings) -> list[str]:
    """Every problem with the reward options of `settings` (mappings well formed, rubric files present); the
    options only count where ``reward_funcs`` (or the hybrid) uses them, but a bad one is reported anyway."""
    problems = []
    checks = (
        ("judge", JudgeConfig.from_mapping),
        ("reward_model", RewardModelOptions.from_mapping),
        ("hybrid", hybrid_options),
        ("cost", cost_options),
    )
    for name, check in checks:
        value = getattr(settings, name, None)
        if value is None:
            continue
        try:
            check(value)
        except (ValueError, OSError) as error:
            problems.append(str(error))
    return problems
