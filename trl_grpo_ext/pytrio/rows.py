"""Training rows for the PyTRIO loop: the TRL recipe's dataset (`trl_grpo_ext.task.data.load_dataset_split`), as dicts.

One loader for both execution paths: the same prompts (`trl_grpo_ext.task.data.prompts.build_prompt`), the same columns
(``prompt``, ``question``, ``answer``, ``task`` for synthetic problems), and the same checks (a GSM8K row without a
question or with an unparseable answer is an error naming the row, or dropped with ``on_malformed: drop``). The
columns other than ``prompt`` reach the reward functions as keyword arguments, as TRL passes dataset columns.
"""

from __future__ import annotations

from trl_grpo_ext.environments.data import with_environments
from trl_grpo_ext.task.data import load_dataset_split


def load_train_rows(config, chat: bool = True) -> list[dict]:
    """The training rows of `config`'s data spec (`trl_grpo_ext.task.spec.DataSpec`) as the TRL recipe builds them:
    ``num_train_samples`` unset and synthetic data: enough problems for ``max_steps`` (`DataSpec.train_samples`);
    prompts as chat messages or plain text (`chat`: ``prompt_format`` resolved with the tokenizer)."""
    dataset = load_dataset_split(
        config.dataset_name,
        config.dataset_train_split,
        num_samples=config.train_samples(config.max_steps * config.prompts_per_step, config),
        tasks=config.synthetic_tasks,
        seed=config.seed,
        one_shot=config.one_shot,
        chat=chat,
        on_malformed=config.on_malformed,
    )
    environments = getattr(config, "environments", None)
    if environments and chat:  # the same rows as the TRL recipe's with `environments:`
        dataset = with_environments(dataset, environments, seed=config.seed, one_shot=config.one_shot)
    rows = dataset.to_list()
    if not rows:
        raise ValueError(f"dataset {config.dataset_name!r} produced no rows")
    return rows
