"""Training rows of a run with tools: the recipe's problems for the calculator, the retrieval environment's own
problems, or both interleaved (each row naming its environment in the ``environment`` column TRL routes by)."""

from __future__ import annotations

from collections.abc import Sequence

from trl_grpo_ext.environments.registry import ENVIRONMENTS
from trl_grpo_ext.environments.retrieval import retrieval_problems
from trl_grpo_ext.task.data.prompts import SYSTEM_PROMPT, build_prompt

TOOL_HINT = " You may call the tools you are given and use their results."


def environment_name_problems(names: Sequence[str]) -> list[str]:
    """The recipes' ``environments`` key: known names, each once."""
    unknown = [name for name in names if name not in ENVIRONMENTS]
    problems = [f"environments: unknown {unknown!r}; choose from {sorted(ENVIRONMENTS)}"] if unknown else []
    if len(set(names)) != len(names):
        problems.append(f"environments: a name is repeated in {list(names)!r}")
    return problems


def with_environments(dataset, names: Sequence[str], seed: int = 0, one_shot: bool = True):
    """`dataset` (rows with a chat ``prompt``, ``question``, ``answer``) for a run with `names`' environments:
    the system prompt says tools may be called; with ``retrieval``, every row (alone) or every other row (mixed)
    becomes a problem that needs a fact of its table (``fact``); with several, each row gets ``environment``."""
    from datasets import Dataset

    if not names:
        return dataset
    rows = dataset.to_list()
    if rows and not isinstance(rows[0]["prompt"], list):
        raise ValueError("environments need chat prompts (prompt_format: chat and a model with a chat template)")
    facts = iter(retrieval_problems(len(rows), seed=seed)) if "retrieval" in names else None
    out = []
    for index, row in enumerate(rows):
        name = names[index % len(names)]
        if name == "retrieval":
            problem = next(facts)
            row = {**row, **problem, "prompt": build_prompt(problem["question"], one_shot=one_shot, chat=True)}
            if "task" in row:
                row["task"] = "retrieval"
        else:
            row = {**row, "fact": None} if facts is not None else dict(row)
        row["prompt"] = [
            {**m, "content": m["content"] + TOOL_HINT}
            if m["role"] == "system" and m["content"] == SYSTEM_PROMPT
            else m
            for m in row["prompt"]
        ]
        if len(names) > 1:
            row["environment"] = name
        out.append(row)
    return Dataset.from_list(out)
