"""Prompt builder shared by the TRL recipes, the PyTRIO loop and evaluation.

One instruction everywhere: reason briefly, then put the final number inside `\\boxed{}` (what the
`boxed` reward checks). The optional one-shot example shows that format once; small models such as
SmolLM2-135M rarely produce `\\boxed{}` zero-shot (3-8% of answers) and learn it much faster with it.
"""

from __future__ import annotations

# Kept short on purpose: every prompt token is paid for in generation and in the backward pass.
SYSTEM_PROMPT = "Solve the math problem. Reason briefly, then give the final number in \\boxed{}."

# A short worked example: brief reasoning and a single boxed integer, like the answers we reward.
ONE_SHOT_QUESTION = "Tom has 3 bags of 4 apples. He eats 2. How many apples are left?"
ONE_SHOT_ANSWER = "3 * 4 = 12 apples. 12 - 2 = 10.\n\\boxed{10}"


def build_prompt(question: str, one_shot: bool = True, chat: bool = True, system_prompt: str | None = SYSTEM_PROMPT):
    """Prompt for one question.

    chat=True: a list of chat messages (TRL's conversational `prompt` format) with an optional system
    message and the one-shot exchange. chat=False: a plain-text prompt for models without a chat template,
    ending with "Answer:" so the model continues with its solution.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    question = question.strip()
    if chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if one_shot:
            messages += [
                {"role": "user", "content": ONE_SHOT_QUESTION},
                {"role": "assistant", "content": ONE_SHOT_ANSWER},
            ]
        messages.append({"role": "user", "content": question})
        return messages
    parts = [system_prompt] if system_prompt else []
    if one_shot:
        parts.append(f"Question: {ONE_SHOT_QUESTION}\nAnswer: {ONE_SHOT_ANSWER}")
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)
