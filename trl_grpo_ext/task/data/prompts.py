"""Prompt builder shared by the TRL recipes, the PyTRIO loop and evaluation.

One instruction everywhere: reason briefly, then put the final number inside `\\boxed{}` (what the
`boxed` reward checks). The optional one-shot example shows that format once; small models such as
SmolLM2-135M rarely produce `\\boxed{}` zero-shot (3-8% of answers) and learn it much faster with it.
The example is of the question's kind: a word problem for GSM8K-style questions, a bare expression for the
synthetic arithmetic tasks (`one_shot_example`).
"""

from __future__ import annotations

# Kept short on purpose: every prompt token is paid for in generation and in the backward pass.
SYSTEM_PROMPT = "Solve the math problem. Reason briefly, then give the final number in \\boxed{}."

# A short worked example: brief reasoning and a single boxed integer, like the answers we reward.
ONE_SHOT_QUESTION = "Tom has 3 bags of 4 apples. He eats 2. How many apples are left?"
ONE_SHOT_ANSWER = "3 * 4 = 12 apples. 12 - 2 = 10.\n\\boxed{10}"
# The example for bare arithmetic (docs/experiments.md): after RL with the word
# example above, SmolLM2-135M boxed a different number than the one it had just computed in 83 of 320 held-out
# arithmetic answers (`1 - 0 = 1.` then `\\boxed{10}`: the example's two-digit box), 0-19 of 320 with this one.
# It also shows a step at a time and a negative intermediate, the model's commonest arithmetic slip.
ARITHMETIC_ONE_SHOT_QUESTION = "Calculate 3 - 8 + 2."
ARITHMETIC_ONE_SHOT_ANSWER = "3 - 8 = -5. -5 + 2 = -3.\n\\boxed{-3}"
# Tasks (the rows' `task`, `trl_grpo_ext.task.data.synthetic.TASKS`) whose questions are bare expressions.
ARITHMETIC_TASKS = frozenset({"chain_sum_easy", "chain_sum", "basic_arithmetic"})


PROMPT_FORMATS = ("auto", "chat", "text")


def use_chat_prompts(prompt_format: str, tokenizer) -> bool:
    """Whether prompts are chat messages (`build_prompt`'s ``chat``) for ``prompt_format`` (`PROMPT_FORMATS`):
    ``auto`` when the tokenizer has a chat template; ``chat`` without one is a one-line ValueError."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "auto":
        return has_template
    if prompt_format == "chat" and not has_template:
        raise ValueError("prompt_format: chat, but the tokenizer has no chat template; use 'text' or 'auto'")
    return prompt_format == "chat"


def one_shot_example(task: str | None = None) -> tuple[str, str]:
    """(question, answer) of the worked example for a row of `task`: arithmetic or word problem (the default)."""
    if task in ARITHMETIC_TASKS:
        return ARITHMETIC_ONE_SHOT_QUESTION, ARITHMETIC_ONE_SHOT_ANSWER
    return ONE_SHOT_QUESTION, ONE_SHOT_ANSWER


def build_prompt(
    question: str,
    one_shot: bool = True,
    chat: bool = True,
    system_prompt: str | None = SYSTEM_PROMPT,
    task: str | None = None,
):
    """Prompt for one question (`task`: the row's task, which picks the one-shot example).

    chat=True: a list of chat messages (TRL's conversational `prompt` format) with an optional system
    message and the one-shot exchange. chat=False: a plain-text prompt for models without a chat template,
    ending with "Answer:" so the model continues with its solution.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    question = question.strip()
    example_question, example_answer = one_shot_example(task)
    if chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if one_shot:
            messages += [
                {"role": "user", "content": example_question},
                {"role": "assistant", "content": example_answer},
            ]
        messages.append({"role": "user", "content": question})
        return messages
    parts = [system_prompt] if system_prompt else []
    if one_shot:
        parts.append(f"Question: {example_question}\nAnswer: {example_answer}")
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)
