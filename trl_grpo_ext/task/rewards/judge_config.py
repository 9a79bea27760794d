"""The rubric judge's settings: the recipe's ``judge:`` mapping (`JudgeConfig`), checked in one line, and the
system prompt its rubric and score format make."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from trl_grpo_ext.task.rewards.reward_model import mapping_option

SCORE_FORMATS = ("integer", "json")
MODES = ("pointwise", "pairwise")
# A local server takes any key; the openai client refuses an empty one.
NO_KEY = "EMPTY"


@dataclass
class JudgeConfig:
    """The recipe's ``judge:`` mapping."""

    base_url: str = ""  # the OpenAI client's form: http://127.0.0.1:8000/v1
    model: str = ""  # the model name the server lists at /v1/models; 'auto': the one model it lists
    rubric: str | None = None  # the grading instructions, or
    rubric_file: str | None = None  # a file holding them (relative to the working directory)
    mode: str = "pointwise"  # or 'pairwise': each completion against the others of its prompt, both orders asked
    score_format: str = "integer"  # 'integer' (the reply's first integer) or 'json' (a JSON object's score_field)
    score_field: str = "score"
    score_range: list = field(default_factory=lambda: [1, 10])  # [low, high], mapped to [0, 1]
    logprobs: bool = False  # the probability-weighted score where the server returns token log-probabilities
    max_concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 3  # by the openai client: 0.5 s before the first, doubling
    cache: bool = True
    seed: int | None = 0
    max_tokens: int = 16
    api_key_env: str = "OPENAI_API_KEY"
    max_failed_steps: int = 3  # steps in a row whose every request failed before the run stops
    name: str = "judge_reward"  # TRL's ``rewards/<name>/mean``

    @classmethod
    def from_mapping(cls, value) -> JudgeConfig:
        """The config from the recipe's mapping (or JSON text); every problem in one ValueError line."""
        mapping = mapping_option("judge", value)
        if not mapping:
            raise ValueError("reward 'judge' needs a judge: mapping with at least base_url, model and rubric")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"judge: unknown key(s) {unknown}; valid: {sorted(known)}")
        config = cls(**mapping)
        problems = config.problems()
        if problems:
            raise ValueError("judge: " + "; ".join(problems))
        if config.rubric_file:
            config.rubric = Path(config.rubric_file).expanduser().read_text(encoding="utf-8")
        return config

    def problems(self) -> list[str]:
        problems = []
        if not (isinstance(self.base_url, str) and re.match(r"^https?://", self.base_url)):
            problems.append(f"base_url={self.base_url!r} must be an http(s) URL such as http://127.0.0.1:8000/v1")
        if not (isinstance(self.model, str) and self.model.strip()):
            problems.append("model must name the judge model as the server knows it")
        if bool(self.rubric) == bool(self.rubric_file):
            problems.append("set exactly one of rubric (text) and rubric_file (a path)")
        elif self.rubric_file and not Path(self.rubric_file).expanduser().is_file():
            problems.append(f"rubric_file {self.rubric_file!r} does not exist")
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r} must be one of {', '.join(MODES)}")
        if self.mode == "pairwise" and self.logprobs:
            problems.append("logprobs: true weighs a pointwise score; pairwise mode parses the preferred side")
        if self.score_format not in SCORE_FORMATS:
            problems.append(f"score_format={self.score_format!r} must be one of {', '.join(SCORE_FORMATS)}")
        r = self.score_range
        if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(_is_int(v) for v in r) and r[0] < r[1]):
            problems.append(f"score_range={r!r} must be [low, high], integers with low < high")
        if self.logprobs and self.score_format != "integer":
            problems.append("logprobs: true weighs integer scores; it needs score_format: integer")
        for name, low in (("max_concurrency", 1), ("retries", 0), ("max_tokens", 1), ("max_failed_steps", 1)):
            value = getattr(self, name)
            if not (_is_int(value) and value >= low):
                problems.append(f"{name}={value!r} must be an integer >= {low}")
        value = self.timeout_s
        if not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            problems.append(f"timeout_s={value!r} must be a number > 0")
        if not (isinstance(self.api_key_env, str) and self.api_key_env.strip()):
            problems.append("api_key_env must name an environment variable")
        return problems

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/")

    def api_key(self) -> str:
        return os.environ.get(self.api_key_env) or NO_KEY

    def system_prompt(self) -> str:
        low, high = self.score_range
        if self.score_format == "json":
            shape = f'a JSON object {{"{self.score_field}": <an integer from {low} to {high}>}}'
        else:
            shape = f"the score, an integer from {low} to {high}"
        return f"{self.rubric.strip()}\n\nReply with only {shape}."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
