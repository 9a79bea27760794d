"""Which prompt tokens a batch shares, planned from prompt boundaries (`plan_prefix`: what the TRL path knows) or
from token sequences alone (`plan_token_rows`: what the local PyTRIO server sees), and TRL's prompt layout.

Both give a `PrefixPlan` (level-1 prefix, level-2 groups), which the rest of the engine (`packing`, `attention`,
`cost`) lays out and runs the same way whichever planned it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixPlan:
    """Which prompt tokens a batch shares.

    Attributes:
        prompts: each row's prompt tokens (no padding).
        prefix_length: level 1, the number of leading tokens all rows share; at most ``min(len(p)) - 1`` so that
            every row keeps its last prompt token (whose hidden state scores the first completion token).
        groups: level 2, row indices of each distinct prompt, in order of first appearance (`plan_token_rows`:
            of rows whose prompts agree up to their last token, which each row encodes itself).
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
    length = _common_length(prompts, min(len(p) for p in prompts) - 1)
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


def _common_length(rows: Sequence[Sequence[int]], limit: int) -> int:
    """Leading tokens all `rows` share, at most `limit` (each row at least `limit` long)."""
    # the first column where some row differs from the first (one comparison op, no loop over tokens)
    heads = torch.tensor([r[:limit] for r in rows], dtype=torch.long).reshape(len(rows), limit)
    differs = (heads != heads[:1]).any(0)
    return int(differs.int().argmax()) if bool(differs.any()) else limit


@dataclass(frozen=True)
class TokenRowsPlan:
    """How rows known only as token sequences (the local PyTRIO server's data) share their leading tokens.

    Attributes:
        shared: indices of the rows that share at least `min_shared` leading tokens with another row, in order.
        plan: the `PrefixPlan` of those rows (row ``i`` of the plan is row ``shared[i]``), whose prompt is each
            row's shared tokens and the next one, and completion the rest (`completions`); ``None`` when no row
            shares.
        plain: the other rows, in order (nothing to share with: the caller runs them unshared).
    """

    shared: tuple[int, ...]
    plan: PrefixPlan | None
    plain: tuple[int, ...]

    def completions(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each shared row's tokens after its plan prompt (its own segment's tokens after the first)."""
        return [list(sequences[r][len(p) :]) for r, p in zip(self.shared, self.plan.prompts, strict=True)]


def plan_token_rows(sequences: Sequence[Sequence[int]], min_shared: int) -> TokenRowsPlan:
    """Group `sequences` (token id lists, each non-empty) by their common prefixes, without prompt boundaries.

    A row joins the earlier group with which it shares the most leading tokens, at least `min_shared` (fewer save
    less than a segment costs), and at most its own length minus one (a row keeps its last token, whose hidden
    state scores the next one); it may not shorten a group's shared length once the group has two rows (a row with
    only the system prompt in common would otherwise pull a whole GRPO group down to it): it starts its own group
    instead. Groups of one row are `plain`. The shared rows' level-1 prefix is the prefix all their groups share.
    """
    rows = [np.asarray(s, dtype=np.int64) for s in sequences]
    if any(r.size == 0 for r in rows):
        raise ValueError("plan_token_rows needs a non-empty token sequence in every row")
    groups: list[list] = []  # [member rows, representative tokens, shared length]
    for i, row in enumerate(rows):
        best, best_shared = None, 0
        for group in groups:
            shared = min(group[2], _common_prefix(group[1], row), row.size - 1)
            if shared > best_shared and (len(group[0]) == 1 or shared == group[2]):
                best, best_shared = group, shared
        if best is not None and best_shared >= min_shared:
            best[0].append(i)
            best[2] = best_shared
        else:
            groups.append([[i], row, row.size - 1])
    shared_groups = [g for g in groups if len(g[0]) > 1]
    plain = tuple(sorted(i for g in groups if len(g[0]) == 1 for i in g[0]))
    if not shared_groups:
        return TokenRowsPlan((), None, plain)
    shared = tuple(sorted(i for g in shared_groups for i in g[0]))
    length_of = {i: g[2] for g in shared_groups for i in g[0]}
    group_of = {i: n for n, g in enumerate(shared_groups) for i in g[0]}
    prompts = tuple(tuple(int(t) for t in rows[i][: length_of[i] + 1]) for i in shared)
    # groups numbered in order of first appearance among the shared rows, as `plan_prefix` numbers them
    order = list(dict.fromkeys(group_of[i] for i in shared))
    number = {g: n for n, g in enumerate(order)}
    row_group = tuple(number[group_of[i]] for i in shared)
    members = tuple(tuple(k for k, g in enumerate(row_group) if g == n) for n in range(len(order)))
    representatives = [prompts[m[0]] for m in members]
    length = _common_length(representatives, min(len(p) for p in prompts) - 1)
    return TokenRowsPlan(shared, PrefixPlan(prompts, length, members, row_group), plain)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


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
