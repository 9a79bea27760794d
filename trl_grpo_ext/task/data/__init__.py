"""Datasets for the recipes: GSM8K (hub or JSONL) and offline reasoning-gym problems, as TRL prompts.

`load_dataset_split(source, split, ...)` returns a `datasets.Dataset` with TRL's `prompt` column and the
ground-truth `answer` (GSM8K style, `... #### N`) that the rewards receive as a keyword argument.
"""

from trl_grpo_ext.task.data.loading import SYNTHETIC_SOURCE, load_dataset_split, load_problems
from trl_grpo_ext.task.data.prompts import (
    ARITHMETIC_ONE_SHOT_ANSWER,
    ARITHMETIC_ONE_SHOT_QUESTION,
    ONE_SHOT_ANSWER,
    ONE_SHOT_QUESTION,
    SYSTEM_PROMPT,
    build_prompt,
    one_shot_example,
)
from trl_grpo_ext.task.data.synthetic import TASKS, generate_problems, parse_task_mix

__all__ = [
    "ARITHMETIC_ONE_SHOT_ANSWER",
    "ARITHMETIC_ONE_SHOT_QUESTION",
    "ONE_SHOT_ANSWER",
    "ONE_SHOT_QUESTION",
    "SYNTHETIC_SOURCE",
    "SYSTEM_PROMPT",
    "TASKS",
    "build_prompt",
    "generate_problems",
    "load_dataset_split",
    "load_problems",
    "one_shot_example",
    "parse_task_mix",
]
