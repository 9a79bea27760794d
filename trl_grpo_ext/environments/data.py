"""Training rows of a run with tools: the recipe's problems for the calculator, the retrieval environment's own
problems, or both interleaved (each row naming its environment in the ``environment`` column TRL routes by)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from trl_grpo_ext.environments.registry import ENVIRONMENTS
from trl_grpo_ext.environments.retrieval import retrieval_problems
from trl_grpo_ext.task.data.prompts import (
    ARITHMETIC_ONE_SHOT_ANSWER,
    ARITHMETIC_ONE_SHOT_QUESTION,
    ONE_SHOT_ANSWER,
    ONE_SHOT_QUESTION,
    SYSTEM_PROMPT,
    build_prompt,
)

TOOL_HINT = " You may call the tools you are given and use their results."

# The one-shot examples, worked with a tool call: (tool, its arguments) per example question.
_EXAMPLE_CALLS = {
    ONE_SHOT_QUESTION: ("calculate", {"expression": "3 * 4 - 2"}),
    ARITHMETIC_ONE_SHOT_QUESTION: ("calculate", {"expression": "3 - 8 + 2"}),
}
RETRIEVAL_EXAMPLE_QUESTION = (
    "There are 2 weeks and 3 more days besides. How many days are there in total? Look up 'days in a week' if you "
    "do not know it."
)


def _call_text(name: str, arguments: dict) -> str:
    # a tool call as the Qwen 2.5 / ChatML tool template writes it, kept as text so every row has one message shape
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _tool_example(prompt: list[dict], environment: str) -> list[dict]:
    """`prompt` with its one-shot exchange replaced by the row's tool in use: the example question and an assistant
    turn that only calls the environment's tool (unchanged when the prompt has no known one-shot exchange).

    The example ends at the call on purpose: SmolLM2-135M copies the last assistant turn it was shown. With the
    whole exchange (the call, the tool's result, then the worked answer) it answers directly and never opens a
    ``<tool_call>`` (0 calls in 32 completions; the probability of the call's first tokens, ``<tool_call>`` and
    the tool's name, averaged under 0.001 over 16 prompts); ending the example at the call makes it 0.36. The answer
    format stays in the system prompt (``\\boxed{}``)."""
    users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
    if len(users) < 2 or prompt[users[0] + 1]["role"] != "assistant":
        return prompt
    first = users[0]
    if environment == "retrieval":
        question = RETRIEVAL_EXAMPLE_QUESTION
        name, arguments = "lookup", {"topic": "days in a week"}
    else:
        question, answer = prompt[first]["content"], prompt[first + 1]["content"]
        if question not in _EXAMPLE_CALLS or answer not in (ONE_SHOT_ANSWER, ARITHMETIC_ONE_SHOT_ANSWER):
            return prompt
        name, arguments = _EXAMPLE_CALLS[question]
    exchange = [{"role": "user", "content": question}, {"role": "assistant", "content": _call_text(name, arguments)}]
    return prompt[:first] + exchange + prompt[first + 2 :]


def environment_name_problems(names: Sequence[str]) -> list[str]:
    """The recipes' ``environments`` key: known names, each once."""
    unknown = [name for name in names if name not in ENVIRONMENTS]
    problems = [f"environments: unknown {unknown!r}; choose from {sorted(ENVIRONMENTS)}"] if unknown else []
    if len(set(names)) != len(names):
        problems.append(f"environments: a name is repeated in {list(names)!r}")
    return problems


def with_environments(dataset, names: Sequence[str], seed: int = 0, one_shot: bool = True):
    """`dataset` (rows with a chat ``prompt``, ``question``, ``answer``) for a run with `names`' environments:
    the system prompt says tools may be called, the one-shot example shows the row's tool called (`_tool_example`); with ``retrieval``, every row (alone) or every other row (mixed)
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
            for m in _tool_example(row["prompt"], name)
        ]
        if len(names) > 1:
            row["environment"] = name
        out.append(row)
    return Dataset.from_list(out)
