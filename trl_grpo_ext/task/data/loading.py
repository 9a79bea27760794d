"""`load_dataset_split`: one entry point from a source name to TRL's prompt dataset."""

from __future__ import annotations

from trl_grpo_ext.task.data.gsm8k import load_gsm8k_rows, validate_rows
from trl_grpo_ext.task.data.prompts import SYSTEM_PROMPT, build_prompt
from trl_grpo_ext.task.data.synthetic import generate_problems

SYNTHETIC_SOURCE = "synthetic"
DEFAULT_TASKS = "chain_sum_easy:2,chain_sum:2,basic_arithmetic:1,gsm_symbolic:1"


def load_problems(
    source: str,
    split: str = "train",
    num_samples: int | None = None,
    tasks: str = DEFAULT_TASKS,
    seed: int = 0,
    on_malformed: str = "error",
) -> list[dict]:
    """GSM8K-schema rows (`question`, `answer`): `source` is 'synthetic' (reasoning-gym, offline),
    'openai/gsm8k' / 'gsm8k' (hub) or a JSONL path. Synthetic train and test splits never share a problem."""
    if num_samples is not None and num_samples <= 0:
        raise ValueError(f"num_samples must be > 0 or None, got {num_samples}")
    if source == SYNTHETIC_SOURCE:
        return generate_problems(num_samples or 1024, split=split, tasks=tasks, seed=seed)
    rows = validate_rows(load_gsm8k_rows(source, split), on_malformed=on_malformed, source=f"{source} [{split}]")
    return rows[:num_samples] if num_samples else rows


def load_dataset_split(
    source: str,
    split: str = "train",
    num_samples: int | None = None,
    tasks: str = DEFAULT_TASKS,
    seed: int = 0,
    one_shot: bool = True,
    chat: bool = True,
    system_prompt: str | None = SYSTEM_PROMPT,
    on_malformed: str = "error",
):
    """A `datasets.Dataset` with `prompt` (chat messages, or text if chat=False), `answer` and `question`."""
    from datasets import Dataset

    rows = load_problems(source, split, num_samples, tasks=tasks, seed=seed, on_malformed=on_malformed)
    records = []
    for row in rows:
        record = {
            "prompt": build_prompt(
                row["question"], one_shot=one_shot, chat=chat, system_prompt=system_prompt, task=row.get("task")
            ),
            "question": row["question"],
            "answer": row["answer"],
        }
        if "task" in row:
            record["task"] = row["task"]
        records.append(record)
    return Dataset.from_list(records)
