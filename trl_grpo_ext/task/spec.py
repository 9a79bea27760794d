"""One data spec: the data, prompt and reward options both execution paths share, declared once.

`DataSpec` is to the task what `trl_grpo_ext.grpo.spec.GRPOSpec` is to the algorithm: one name, one meaning, one
default and one validator (`data_problems`) for each option, spelled as TRL users know them (TRL's
``ScriptArguments``: ``dataset_name``, ``dataset_train_split``; PEFT's ``lora_r``). It lives in the task package,
beside the data loader and the rewards it describes (`RewardSettings` is its base), in the layer of `grpo`, which
may not import the task.

- ``ScriptArguments(DataSpec)`` (`trl_grpo_ext.trl.script_args`): the TRL recipe adds its eval, prompt format and
  logging options; its ``__post_init__`` runs this one.
- ``PyTrioGRPOConfig(GRPOSpec, DataSpec)`` (`trl_grpo_ext.pytrio.config`): validates everything at once, this spec's
  problems included.
- ``EvalOptions.one_shot`` (`trl_grpo_ext.evaluation.options`) is this spec's declaration (`data_field`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.task.data import SYNTHETIC_SOURCE, parse_task_mix
from trl_grpo_ext.task.data.gsm8k import ON_MALFORMED
from trl_grpo_ext.task.data.loading import DEFAULT_TASKS
from trl_grpo_ext.task.data.prompts import PROMPT_FORMATS
from trl_grpo_ext.task.rewards.settings import RewardSettings, reward_settings_problems

# Problems added to a generated (synthetic) training set beyond what the run consumes.
SYNTHETIC_MARGIN = 64


def reward_funcs_list(value) -> list[str]:
    """``reward_funcs`` as a list of names: a string is split on commas (both paths take 'boxed,format')."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return list(value or [])


def prompt_pool_factor(config, task_mix=None) -> int:
    """How many times a plain run's prompts a generated training set should hold so that no prompt repeats:
    dynamic sampling may use ``max_generation_batches`` generation batches a step, and the curriculum may draw
    every prompt from the task with the smallest share of ``task_mix`` ('task:weight,...')."""
    factor = 1
    if getattr(config, "dynamic_sampling", False):
        factor *= config.max_generation_batches
    if getattr(config, "curriculum", False) and task_mix:
        factor *= math.ceil(1.0 / min(parse_task_mix(task_mix).values()) - 1e-9)
    return factor


@dataclass
class DataSpec(RewardSettings):
    """The data, prompt and reward options of both paths (docs/recipes.md); the reward options' settings
    (judge, reward_model, hybrid, cost) come from `RewardSettings`."""

    dataset_name: str = field(
        default=SYNTHETIC_SOURCE,
        metadata={
            "help": "'synthetic' (offline reasoning-gym problems, see synthetic_tasks), 'openai/gsm8k' (hub; 'gsm8k' "
            "too) or a local JSONL file / folder of <split>.jsonl with question/answer rows."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split used for training."})
    num_train_samples: int | None = field(
        default=None,
        metadata={
            "help": "Training problems: synthetic: how many to generate (None: enough for max_steps, so no prompt "
            "repeats); hub or file: the first N rows (None: all)."
        },
    )
    synthetic_tasks: str = field(
        default=DEFAULT_TASKS,
        metadata={
            "help": "Synthetic task mix 'task:weight,...' (tasks: chain_sum_easy, chain_sum, basic_arithmetic, "
            "gsm_symbolic). Each problem draws its task by weight: an easy-to-hard mix in every batch."
        },
    )
    on_malformed: str = field(
        default="error",
        metadata={"help": "Rows without question/answer or with an unparseable answer: 'error' or 'drop'."},
    )
    one_shot: bool = field(
        default=True, metadata={"help": "Put one worked example (answer in \\boxed{}) in the prompt."}
    )
    prompt_format: str = field(
        default="auto",
        metadata={"help": "'chat' messages, plain 'text', or 'auto' (chat if the tokenizer has a chat template)."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed", "format"],
        metadata={
            "help": "Reward names from trl_grpo_ext.REWARD_REGISTRY, 'judge', 'cost', or a reward model's folder or "
            "hub id, as in TRL (weights: reward_weights; options: judge, reward_model, hybrid, cost)."
        },
    )

    def __post_init__(self):
        raise_problems("data options", self.data_problems())

    def data_problems(self) -> list[str]:
        """Every problem with this spec's options, each starting with its key (``reward_funcs`` made a list first)."""
        self.reward_funcs = reward_funcs_list(self.reward_funcs)
        problems = []
        if not isinstance(self.dataset_name, str) or not self.dataset_name.strip():
            problems.append(f"dataset_name={self.dataset_name!r} must name 'synthetic', a hub id or a JSONL path")
        if self.num_train_samples is not None and not (
            isinstance(self.num_train_samples, int) and self.num_train_samples > 0
        ):
            problems.append(f"num_train_samples must be > 0 or unset, got {self.num_train_samples!r}")
        if self.dataset_name == SYNTHETIC_SOURCE:
            try:
                parse_task_mix(self.synthetic_tasks)
            except (TypeError, ValueError) as error:
                problems.append(f"synthetic_tasks={self.synthetic_tasks!r}: {error}")
        if self.on_malformed not in ON_MALFORMED:
            problems.append(f"on_malformed must be 'error' or 'drop', got {self.on_malformed!r}")
        if not isinstance(self.one_shot, bool):
            problems.append(f"one_shot={self.one_shot!r} must be true or false")
        if self.prompt_format not in PROMPT_FORMATS:
            problems.append(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if not self.reward_funcs:
            problems.append("reward_funcs is empty; name at least one reward (e.g. boxed)")
        return problems + reward_settings_problems(self)

    def train_samples(self, prompts_per_run: int, config) -> int | None:
        """``num_train_samples``, or for synthetic data without it enough problems for `prompts_per_run` prompts
        (x `prompt_pool_factor` of the GRPO `config`, + `SYNTHETIC_MARGIN`); None: every row of a hub or file."""
        if self.num_train_samples is not None or self.dataset_name != SYNTHETIC_SOURCE:
            return self.num_train_samples
        return prompts_per_run * prompt_pool_factor(config, self.synthetic_tasks) + SYNTHETIC_MARGIN


def data_field(name: str, **metadata):
    """`DataSpec`'s declaration of `name` (default and help), for a config that holds that one option."""
    spec = DataSpec.__dataclass_fields__[name]
    return field(default=spec.default, metadata={**spec.metadata, **metadata})
