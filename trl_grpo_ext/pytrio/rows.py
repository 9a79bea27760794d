"""Training rows for the PyTRIO loop: the TRL recipe's dataset (`trl_grpo_ext.task.data.load_dataset_split`), as dicts.

One loader for both execution paths: the same prompts (`trl_grpo_ext.task.data.prompts.build_prompt`), the same columns
(``prompt``, ``question``, ``answer``, ``task`` for synthetic problems), and the same checks (a GSM8K row without a
question or with an unparseable answer is an error naming the row, or dropped with ``on_malformed: drop``). The
columns other than ``prompt`` reach the reward functions as keyword arguments, as TRL passes dataset columns.
"""

from __future__ import annotations

from trl_grpo_ext.task.data import load_dataset_split
from trl_grpo_ext.task.data.gsm8k import HUB_ID
from trl_grpo_ext.task.data.loading import SYNTHETIC_SOURCE


def data_source(config) -> str:
    """`load_dataset_split`'s source for the config: 'synthetic', the ``dataset_path`` JSONL, or the hub's GSM8K."""
    if config.dataset_name == "synthetic":
        return SYNTHETIC_SOURCE
    if config.dataset_name == "gsm8k":
        return config.dataset_path or HUB_ID
    raise ValueError(f"dataset_name must be 'gsm8k' or 'synthetic', got {config.dataset_name!r}")


def load_train_rows(config) -> list[dict]:
    dataset = load_dataset_split(
        data_source(config),
        config.dataset_split,
        num_samples=config.dataset_size,
        tasks=config.synthetic_tasks,
        seed=config.seed,
        one_shot=config.one_shot,
        chat=True,
        on_malformed=config.on_malformed,
    )
    rows = dataset.to_list()
    if not rows:
        raise ValueError(f"dataset {config.dataset_name!r} produced no rows")
    return rows
