"""Training rows for the PyTRIO loop, from the shared data modules: ``{"prompt": messages, "answer": ..., ...}``.

The prompt is `trl_grpo_ext.data.prompts.build_prompt`'s, so both execution paths see the same text; the other
columns reach the reward functions as keyword arguments, as TRL passes dataset columns.
"""

from __future__ import annotations

import json
from pathlib import Path


def _gsm8k_rows(config) -> list[dict]:
    if config.dataset_path:
        path = Path(config.dataset_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dataset_path {path} does not exist")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        from datasets import load_dataset

        rows = list(load_dataset("openai/gsm8k", "main", split=config.dataset_split))
    bad = [i for i, r in enumerate(rows) if not isinstance(r, dict) or "question" not in r or "answer" not in r]
    if bad:
        raise ValueError(f"GSM8K rows need 'question' and 'answer'; row {bad[0]} has {sorted(rows[bad[0]])}")
    return rows[: config.dataset_size] if config.dataset_size else rows


def load_train_rows(config) -> list[dict]:
    from trl_grpo_ext.data.prompts import build_prompt

    if config.dataset_name == "gsm8k":
        problems = _gsm8k_rows(config)
    elif config.dataset_name == "synthetic":
        from trl_grpo_ext.data.synthetic import generate_problems

        problems = generate_problems(
            config.dataset_size or 512, split=config.dataset_split, tasks=config.synthetic_tasks, seed=config.seed
        )
    else:
        raise ValueError(f"dataset_name must be 'gsm8k' or 'synthetic', got {config.dataset_name!r}")
    rows = []
    for problem in problems:
        row = {k: v for k, v in problem.items() if k != "question"}
        row["prompt"] = build_prompt(problem["question"], one_shot=config.one_shot)
        rows.append(row)
    if not rows:
        raise ValueError(f"dataset {config.dataset_name!r} produced no rows")
    return rows
