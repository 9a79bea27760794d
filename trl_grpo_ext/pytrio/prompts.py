"""What the loop samples from: the rows in a seeded order (`PromptStream`), the tokenizer, and each row's prompt as
token ids (`PromptTokens`, with the tools of the row's environment in a multi-turn run)."""

from __future__ import annotations

import random
from pathlib import Path

from trl_grpo_ext.environments import ENVIRONMENTS, environment_tools
from trl_grpo_ext.models import is_embedded, resolve_model
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import redact


class PromptStream:
    """Rows in a seeded order, reshuffled each epoch; ``position`` counts the prompts handed out so far."""

    def __init__(self, rows: list[dict], seed: int, position: int = 0):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.seed = seed
        self.position = position
        self._epoch = None
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def take(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.rows))
            out.append(self.rows[self._order_for(epoch)[index]])
            self.position += 1
        return out


def load_tokenizer(config: PyTrioGRPOConfig, training_client):
    """``tokenizer_name_or_path`` if set, else the client's own (`TrainingClient.get_tokenizer`, the base model's
    tokenizer), else transformers on the locally resolved base model."""
    from transformers import AutoTokenizer

    if config.tokenizer_name_or_path:
        return AutoTokenizer.from_pretrained(config.tokenizer_name_or_path)
    try:
        return training_client.get_tokenizer()
    except Exception as error:  # noqa: BLE001 - fall back to a local copy of the model
        base = config.base_model
        if is_embedded(base) or Path(base).is_dir():
            return AutoTokenizer.from_pretrained(resolve_model(base))
        raise PyTrioLoopError(
            f"no tokenizer for {base!r} ({type(error).__name__}: {redact(error)}); set tokenizer_name_or_path"
        ) from None


def environment_name(config: PyTrioGRPOConfig, row: dict) -> str:
    """The environment a multi-turn row runs in: its ``environment`` column when the run has several."""
    names = config.environments
    return row.get("environment") if len(names) > 1 else names[0]


def environment_tool_methods(config: PyTrioGRPOConfig) -> dict[str, list]:
    """Each environment's tools, as bound methods of an instance (what a chat template renders into the prompt
    and a sampled turn is parsed against)."""
    return {
        name: [getattr(ENVIRONMENTS[name](), f.__name__) for f in environment_tools(ENVIRONMENTS[name])]
        for name in config.environments or ()
    }


class PromptTokens:
    """Each row's prompt as token ids, tokenized once per row: chat messages through the tokenizer's chat template
    (with the tools of the row's environment), text as it is."""

    def __init__(self, config: PyTrioGRPOConfig, tokenizer, tools: dict[str, list]):
        self.config = config
        self.tokenizer = tokenizer
        self.tools = tools
        self._cache: dict[int, list[int]] = {}

    def __call__(self, row: dict) -> list[int]:
        key = id(row)
        if key not in self._cache:
            prompt = row["prompt"]
            tok = self.tokenizer
            if isinstance(prompt, list):
                tools = self.tools[environment_name(self.config, row)] if self.config.environments else None
                text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=tools or None)
            else:
                text = str(prompt)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise PyTrioLoopError("a prompt tokenized to nothing")
            self._cache[key] = list(ids)
        return self._cache[key]
