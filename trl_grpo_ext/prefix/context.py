"""A prompt context: the shared prompt parts of a whole generation batch encoded once (`encode_prompt_context`),
and each chunk of rows encoding only its own tokens on top of the stored keys/values (`context_logps_and_entropies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compat import cache_kwargs
from .packing import DEFAULT_MAX_PACKED_TOKENS, _completions, _unpack
from .plan import PrefixPlan, plan_prefix, prompts_from_left_padded
from .support import _config_of


# Level 1 and 2 encoded once for many chunks of rows (a whole generation batch), each chunk then encoding only its
# rows' own tokens on top of the stored keys/values.
@dataclass
class PromptContext:
    """The shared prompt parts of a set of prompts, encoded once: the level-1 prefix and each distinct prompt's rest.

    Attributes:
        plan: the plan of the distinct prompts (`plan.groups[g]` is the g-th distinct prompt).
        group_of: prompt tokens -> group index.
        keys, values: per layer, (heads, slots, head_dim): every encoded slot of every context bin, flattened
            (slot ``b * bin_length + t`` is bin b's slot t); gradients flow to the model through them.
        prefix_slots: per context bin, the slots of its copy of the level-1 prefix.
        rest_slots: per group, the slots of its prompt's rest (prompt minus prefix minus last token).
        group_bin: per group, the context bin holding its rest.
        tokens: prompt tokens encoded (the prefix once per context bin, each rest once).
    """

    plan: PrefixPlan
    group_of: dict[tuple[int, ...], int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_slots: list[list[int]]
    rest_slots: list[list[int]]
    group_bin: list[int]
    tokens: int

    def with_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> PromptContext:
        """The same context reading other key/value tensors (e.g. detached leaves of these)."""
        return dataclasses.replace(self, keys=keys, values=values)


def _mask_for(model, visible: torch.Tensor) -> torch.Tensor:
    """`visible` (bool) as the 4D mask the model's attention implementation takes (additive float for eager)."""
    if _config_of(model)._attn_implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)
    return visible


def encode_prompt_context(
    model,
    prompts: Sequence[Sequence[int]],
    max_packed_tokens: int = DEFAULT_MAX_PACKED_TOKENS,
    pad_token_id: int = 0,
) -> PromptContext | None:
    """Encode the shared parts of `prompts` (token id lists, repeats allowed) once, keeping every layer's keys/values.

    Context bins ``[level-1 prefix][rest of prompt g1][rest of prompt g2]...`` (a new bin, with its own copy of the
    prefix, when the next rest would push a bin past `max_packed_tokens`), with each token at its position in its own
    prompt and a 4D mask under which a rest sees the prefix and its own earlier tokens: the keys/values the plain
    forward computes for those tokens. Runs with gradients if they are enabled. ``None`` when there is nothing to
    encode (no common prefix and every prompt one token long).
    """
    from transformers import DynamicCache

    distinct = list(dict.fromkeys(tuple(int(t) for t in p) for p in prompts))
    plan = plan_prefix(distinct)
    length = plan.prefix_length
    prefix = plan.prompts[0][:length]
    rests = [plan.remainder(g) for g in range(len(plan.groups))]
    if not length and not any(rests):
        return None
    bins: list[list[tuple[int, int, int]]] = []  # (token, position, group or -1 for the prefix)
    group_bin, rest_start = [], []
    for group, rest in enumerate(rests):
        if not bins or (len(bins[-1]) > length and len(bins[-1]) + len(rest) > max_packed_tokens):
            bins.append([(tok, pos, -1) for pos, tok in enumerate(prefix)])
        group_bin.append(len(bins) - 1)
        rest_start.append(len(bins[-1]))
        bins[-1].extend((tok, length + i, group) for i, tok in enumerate(rest))
    width = max(len(b) for b in bins)
    device = next(model.parameters()).device
    ids = torch.full((len(bins), width), pad_token_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    group_of = torch.full((len(bins), width), -2, dtype=torch.long)
    for b, slots in enumerate(bins):
        tok, p, g = zip(*slots, strict=True)
        ids[b, : len(slots)], pos[b, : len(slots)], group_of[b, : len(slots)] = map(torch.tensor, (tok, p, g))
    gq, gk = group_of.unsqueeze(2), group_of.unsqueeze(1)
    visible = torch.ones(width, width, dtype=torch.bool).tril() & ((gk == -1) | (gk == gq)) & (gk != -2)
    visible |= torch.eye(width, dtype=torch.bool) & (group_of == -2).unsqueeze(2)  # padding sees itself (no NaN)
    cache = DynamicCache(config=_config_of(model))
    model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=_mask_for(model, visible.unsqueeze(1).to(device)),
          **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)  # fmt: skip
    flat = [(layer.keys, layer.values) for layer in cache.layers]
    keys = [k.transpose(0, 1).reshape(k.size(1), -1, k.size(3)) for k, _ in flat]
    values = [v.transpose(0, 1).reshape(v.size(1), -1, v.size(3)) for _, v in flat]
    return PromptContext(
        plan=plan,
        group_of={p: g for g, p in enumerate(plan.prompts)},
        keys=keys,
        values=values,
        prefix_slots=[list(range(b * width, b * width + length)) for b in range(len(bins))],
        rest_slots=[
            list(range(group_bin[g] * width + rest_start[g], group_bin[g] * width + rest_start[g] + len(r)))
            for g, r in enumerate(rests)
        ],
        group_bin=group_bin,
        tokens=sum(len(b) for b in bins),
    )


def context_logps_and_entropies(
    model,
    context: PromptContext,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    max_packed_tokens: int = DEFAULT_MAX_PACKED_TOKENS,
    pad_token_id: int = 0,
):
    """`shared_prefix_logps_and_entropies` for rows whose shared prompt parts `context` holds: the forward encodes
    only each row's last prompt token and completion, attending to the stored keys/values.

    Rows are packed in bins ``[row 1: last prompt token + completion][row 2 ...]`` (a new bin past
    `max_packed_tokens`, stored slots included); each bin's cache holds the context slots its rows read (their
    context bin's prefix, their prompts' rests), gathered from ``context.keys/values``, and a 4D mask lets a row see
    those of its own prompt and its own earlier tokens: the attention the plain forward gives it. Returns
    ``(logps, entropies or None)`` of shape (rows, logits_to_keep), or ``None`` if a row's prompt is not in
    `context` or the layout isn't TRL's.
    """
    from transformers import DynamicCache

    prompt_length = input_ids.size(1) - logits_to_keep
    prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
    if prompts is None:
        return None
    groups = [context.group_of.get(tuple(p)) for p in prompts]
    if any(g is None for g in groups):
        return None
    completions, completion_masks = _completions(input_ids, attention_mask, prompt_length)
    # one bin: context slots (slot, context bin, group or -1 for the prefix) and own slots (token, position, row,
    # key_valid, label)
    bins: list[tuple[list, list, set, set]] = []
    row_slots: list[tuple[int, int, int] | None] = [None] * len(prompts)
    for row in sorted(range(len(prompts)), key=lambda r: (groups[r], r)):
        group, completion = groups[row], completions[row]
        home = context.group_bin[group]
        cost = 1 + len(completion)
        if bins:
            stored, own, homes, seen = bins[-1]
            cost += (0 if home in homes else len(context.prefix_slots[home])) + (
                0 if group in seen else len(context.rest_slots[group])
            )
        if not bins or (bins[-1][1] and len(bins[-1][0]) + len(bins[-1][1]) + cost > max_packed_tokens):
            bins.append(([], [], set(), set()))
        stored, own, homes, seen = bins[-1]
        if home not in homes:
            stored.extend((slot, home, -1) for slot in context.prefix_slots[home])
            homes.add(home)
        if group not in seen:
            stored.extend((slot, home, group) for slot in context.rest_slots[group])
            seen.add(group)
        row_slots[row] = (len(bins) - 1, len(own), len(completion))
        base = len(prompts[row]) - 1
        own.append((prompts[row][-1], base, row, True, -100))
        for j, (tok, valid) in enumerate(zip(completion, completion_masks[row], strict=True)):
            own.append((tok, base + 1 + j, row, bool(valid), tok if valid else -100))

    n_bins = len(bins)
    n_stored, n_own = max(len(b[0]) for b in bins), max(len(b[1]) for b in bins)
    slot = torch.zeros((n_bins, n_stored), dtype=torch.long)
    stored_home = torch.full((n_bins, n_stored), -3, dtype=torch.long)
    stored_group = torch.full((n_bins, n_stored), -3, dtype=torch.long)
    ids = torch.full((n_bins, n_own), pad_token_id, dtype=torch.long)
    pos = torch.zeros((n_bins, n_own), dtype=torch.long)
    row_of = torch.full((n_bins, n_own), -2, dtype=torch.long)
    valid = torch.zeros((n_bins, n_own), dtype=torch.bool)
    labels = torch.full((n_bins, n_own), -100, dtype=torch.long)
    for b, (stored, own, _, _) in enumerate(bins):
        if stored:
            s, h, g = zip(*stored, strict=True)
            slot[b, : len(s)], stored_home[b, : len(s)], stored_group[b, : len(s)] = map(torch.tensor, (s, h, g))
        tok, p, r, v, lab = zip(*own, strict=True)
        n = len(own)
        ids[b, :n], pos[b, :n], row_of[b, :n], valid[b, :n], labels[b, :n] = map(torch.tensor, (tok, p, r, v, lab))
    row_group = torch.tensor(groups + [-2], dtype=torch.long)[row_of]  # row -2 (padding) -> group -2
    row_home = torch.tensor([context.group_bin[g] for g in groups] + [-2], dtype=torch.long)[row_of]
    # a row's token sees its context bin's prefix and its prompt's rest ...
    sees_stored = ((stored_group == -1).unsqueeze(1) & (stored_home.unsqueeze(1) == row_home.unsqueeze(2))) | (
        stored_group.unsqueeze(1) == row_group.unsqueeze(2)
    )
    sees_stored &= (row_of >= 0).unsqueeze(2)
    # ... and its own row's earlier unpadded tokens (padding slots see themselves only: no NaN)
    causal = torch.ones(n_own, n_own, dtype=torch.bool).tril()
    sees_own = causal & (row_of.unsqueeze(1) == row_of.unsqueeze(2)) & valid.unsqueeze(1)
    sees_own |= torch.eye(n_own, dtype=torch.bool) & (row_of == -2).unsqueeze(2)
    visible = torch.cat([sees_stored, sees_own], dim=2).unsqueeze(1)

    device = input_ids.device
    slot = slot.to(device)
    cache = None
    if n_stored:
        # (heads, slots, dim)[:, (bins, n_stored)] -> (bins, heads, n_stored, dim); autograd scatters gradients back
        cache = DynamicCache(
            ddp_cache_data=[
                (k[:, slot].transpose(0, 1), v[:, slot].transpose(0, 1))
                for k, v in zip(context.keys, context.values, strict=True)
            ]
        )
    outputs = model(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        attention_mask=_mask_for(model, visible.to(device)),
        **cache_kwargs(model, cache),
        labels=labels.to(device),
        fused_lm_head=True,
    )
    logps = _unpack(outputs.log_probs, row_slots, logits_to_keep)
    entropies = _unpack(outputs.entropy, row_slots, logits_to_keep) if compute_entropy else None
    return logps, entropies
