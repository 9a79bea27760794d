"""Which prompt tokens a batch shares (`plan_prefix`: level-1 prefix, level-2 groups) and TRL's prompt layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixPlan:
    """Which prompt tokens a batch shares.

    Attributes:
        prompts: each row's prompt tokens (no padding).
        prefix_length: level 1, the number of leading tokens all rows share; at most ``min(len(p)) - 1`` so that
            every row keeps its last prompt token (whose hidden state scores the first completion token).
        groups: level 2, row indices of each distinct prompt, in order of first appearance.
        row_group: the group index of each row.
    """

    prompts: tuple[tuple[int, ...], ...]
    prefix_length: int
    groups: tuple[tuple[int, ...], ...]
    row_group: tuple[int, ...]

    def remainder(self, group: int) -> tuple[int, ...]:
        """Tokens of a group's prompt after the level-1 prefix, without its last token."""
        prompt = self.prompts[self.groups[group][0]]
        return prompt[self.prefix_length : len(prompt) - 1]

    @property
    def plain_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens encoded with sharing: the prefix once, each group's rest once, each row's last token."""
        return self.prefix_length + sum(len(self.remainder(g)) for g in range(len(self.groups))) + len(self.prompts)

    @property
    def shares(self) -> bool:
        """Whether any prompt token is encoded fewer times than in the plain forward."""
        return self.shared_prompt_tokens < self.plain_prompt_tokens


def plan_prefix(prompts: Sequence[Sequence[int]]) -> PrefixPlan:
    """Level-1 prefix and level-2 groups of `prompts` (token id lists, each non-empty)."""
    prompts = tuple(tuple(map(int, p)) for p in prompts)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("plan_prefix needs at least one row and a non-empty prompt in every row")
    limit = min(len(p) for p in prompts) - 1
    # the first column where some row differs from the first (one comparison op, no loop over tokens)
    heads = torch.tensor([p[:limit] for p in prompts], dtype=torch.long).reshape(len(prompts), limit)
    differs = (heads != heads[:1]).any(0)
    length = int(differs.int().argmax()) if bool(differs.any()) else limit
    index: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    row_group = []
    for row, prompt in enumerate(prompts):
        if prompt not in index:
            index[prompt] = len(members)
            members.append([])
        members[index[prompt]].append(row)
        row_group.append(index[prompt])
    return PrefixPlan(prompts, length, tuple(tuple(m) for m in members), tuple(row_group))


def prompts_from_left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int):
    """Each row's prompt tokens from TRL's layout (prompts left-padded to `prompt_length`), or ``None`` if a row's
    prompt mask is not ``0...0 1...1`` with at least one token (then the plain forward's positions can't be
    reproduced)."""
    mask = attention_mask[:, :prompt_length].bool()
    lengths = mask.sum(dim=1)
    expected = torch.arange(prompt_length, device=mask.device).unsqueeze(0) >= (prompt_length - lengths).unsqueeze(1)
    if bool((lengths == 0).any()) or not torch.equal(mask, expected):
        return None
    ids = input_ids[:, :prompt_length].tolist()
    return [row[prompt_length - n :] for row, n in zip(ids, lengths.tolist(), strict=True)]
