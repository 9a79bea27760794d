"""The problems an eval runs on: `Problem` (question, parsed ground truth, the training prompt), built from
GSM8K-schema rows the recipes' own loader reads (`load_rows`, `problems_from_rows`) or from recipe dicts
(`as_problems`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trl_grpo_ext.task.answers import parse_ground_truth
from trl_grpo_ext.task.data import SYNTHETIC_SOURCE, load_problems
from trl_grpo_ext.task.data.gsm8k import HUB_ID, HUB_NAMES
from trl_grpo_ext.task.data.loading import DEFAULT_TASKS
from trl_grpo_ext.task.data.prompts import build_prompt

Prompt = Any  # a list of chat messages, or a plain string for models without a chat template

EMBEDDED_DATA = "embedded"
GSM8K_TEST = "gsm8k-test"
# The held-out split does not depend on the training seed: every run of a sweep, whatever its seed, is
# evaluated on the same problems, so runs can be compared problem by problem.
HELDOUT_SEED = 0


@dataclass
class Problem:
    question: str
    answer: str  # the ground truth, already parsed (e.g. "72" from GSM8K's "... #### 72")
    prompt: Prompt
    id: str | int | None = None
    task: str | None = None  # reasoning-gym task name or data source, for per-task figures


def _ground_truth(row: dict) -> str:
    for key in ("answer", "solution", "ground_truth", "target"):
        if row.get(key) is not None:
            truth = parse_ground_truth(row[key])
            if truth is None or not str(truth).strip():
                raise ValueError(f"cannot parse a ground-truth answer from {row[key]!r}")
            return str(truth)
    raise ValueError(f"row has no answer field (answer/solution/ground_truth): keys {sorted(row)}")


def problems_from_rows(rows: Sequence[dict], one_shot: bool = True, chat: bool = True) -> list[Problem]:
    """GSM8K-schema rows (`question`, `answer`, optional `task`) -> problems with the training prompt (`data.prompts`)."""
    problems = []
    for i, row in enumerate(rows):
        question = row.get("question") or row.get("problem")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"row {i} has no question (keys {sorted(row)})")
        problems.append(
            Problem(
                question,
                _ground_truth(row),
                build_prompt(question, one_shot=one_shot, chat=chat, task=row.get("task")),
                row.get("id", i),
                row.get("task") or row.get("source"),
            )
        )
    return problems


def _prompt_question(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else json.dumps(prompt, sort_keys=True)


def as_problems(items: Sequence[Problem | dict]) -> list[Problem]:
    """`Problem`s from problems or recipe dicts {'prompt', 'answer' (GSM8K style), optional 'question', 'task'}."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Problem):
            out.append(item)
            continue
        if not isinstance(item, dict) or "prompt" not in item or "answer" not in item:
            raise ValueError(f"eval problem {i} needs 'prompt' and 'answer', got {item!r:.100}")
        question = item.get("question") or _prompt_question(item["prompt"])
        out.append(Problem(question, _ground_truth(item), item["prompt"], item.get("id", i), item.get("task")))
    return out


def load_rows(data: str, limit: int | None = None, seed: int = HELDOUT_SEED, tasks: str | None = None) -> list[dict]:
    """GSM8K-schema rows through the recipes' own loader (`trl_grpo_ext.task.data.load_problems`).

    `embedded` / `synthetic`: the offline reasoning-gym test split (never shares a problem with training;
    `tasks` as the recipe's `synthetic_tasks`); `gsm8k-test`: GSM8K test from the hub; otherwise a JSONL
    file, or a folder holding `test.jsonl`, of question/answer rows.
    """
    if limit is not None and limit < 1:
        raise ValueError("--limit must be >= 1")
    if data in (EMBEDDED_DATA, SYNTHETIC_SOURCE):
        return load_problems(SYNTHETIC_SOURCE, "test", limit or 320, tasks=tasks or DEFAULT_TASKS, seed=seed)
    if data == GSM8K_TEST or data in HUB_NAMES:
        return load_problems(HUB_ID, "test", limit)
    if not Path(data).exists():
        raise FileNotFoundError(
            f"eval data '{data}' is neither '{EMBEDDED_DATA}', '{GSM8K_TEST}' nor a JSONL file/folder"
        )
    return load_problems(data, "test", limit)
