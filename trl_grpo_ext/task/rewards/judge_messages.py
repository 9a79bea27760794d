"""What the rubric judge is asked and how its replies are read: the chat of a pointwise grade or a pairwise
comparison, the declared score (or the preferred side) parsed from a reply, the probability-weighted score of a
reply's log-probabilities, and the cache's key."""

from __future__ import annotations

import hashlib
import json
import math
import re

from trl_grpo_ext.task.answers import completion_text
from trl_grpo_ext.task.rewards.judge_config import JudgeConfig

_SIDE = re.compile(r"\b([AB])\b")
_INTEGER = re.compile(r"-?\d+")
_JSON_OBJECT = re.compile(r"\{.*?\}", re.DOTALL)


def question_text(prompt) -> str:
    """The question a prompt asks: the last user message of a conversation, or the prompt text."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else (prompt[-1].get("content", "") if prompt else ""))
    return str(prompt or "")


def judge_messages(config: JudgeConfig, prompt, completion) -> list[dict]:
    """The chat the judge is asked (docs/rewards.md shows it)."""
    user = f"Question:\n{question_text(prompt)}\n\nResponse to grade:\n{completion_text(completion)}"
    return [{"role": "system", "content": config.system_prompt()}, {"role": "user", "content": user}]


def pairwise_messages(config: JudgeConfig, prompt, first, second) -> list[dict]:
    """The chat of a pairwise comparison: response A, then response B."""
    system = f"{config.rubric.strip()}\n\nYou are shown two responses, A and B. Reply with only the letter of the better one: A or B."
    user = (
        f"Question:\n{question_text(prompt)}\n\nResponse A:\n{completion_text(first)}\n\n"
        f"Response B:\n{completion_text(second)}"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_preference(reply: str | None) -> str | None:
    """'A' or 'B': the first standalone letter A or B of the reply; None without one."""
    match = _SIDE.search(reply) if isinstance(reply, str) else None
    return match.group(1) if match else None


def parse_score(config: JudgeConfig, reply: str | None) -> float | None:
    """The declared score of `reply` mapped to [0, 1], or None when it has none in range."""
    if not isinstance(reply, str):
        return None
    value = None
    if config.score_format == "integer":
        match = _INTEGER.search(reply)
        value = int(match.group()) if match else None
    else:
        for candidate in _JSON_OBJECT.findall(reply):
            try:
                obj = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            raw = obj.get(config.score_field) if isinstance(obj, dict) else None
            if isinstance(raw, (int, float)) and not isinstance(raw, bool) and float(raw).is_integer():
                value = int(raw)
                break
    return _normalise(config, value)


def _normalise(config: JudgeConfig, value) -> float | None:
    low, high = config.score_range
    if value is None or not low <= value <= high:
        return None
    return (value - low) / (high - low)


def logprob_score(config: JudgeConfig, choice) -> float | None:
    """The probability-weighted score over the in-range integers among the first token's top log-probabilities,
    mapped to [0, 1]; None when the server returned none."""
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not content:
        return None
    weights: dict[int, float] = {}
    for candidate in getattr(content[0], "top_logprobs", None) or []:
        token = str(getattr(candidate, "token", "")).strip()
        if re.fullmatch(r"-?\d+", token) and config.score_range[0] <= int(token) <= config.score_range[1]:
            weights[int(token)] = weights.get(int(token), 0.0) + math.exp(candidate.logprob)
    total = sum(weights.values())
    if not total:
        return None
    return _normalise(config, sum(v * p for v, p in weights.items()) / total)


def cache_key(config: JudgeConfig, prompt, completion) -> str:
    """The cache's key: rubric and score format, prompt, completion and judge model."""
    if isinstance(completion, list) and all(isinstance(c, str) for c in completion):  # a pairwise (A, B)
        shown = list(completion)
    else:
        shown = completion_text(completion)
    material = [config.system_prompt(), question_text(prompt), shown, config.model, config.logprobs, config.mode]
    return hashlib.sha256(json.dumps(material, ensure_ascii=False).encode()).hexdigest()
