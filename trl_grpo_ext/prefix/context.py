"""A prompt context: the shared prompt parts of a whole generation batch encoded once (`encode_prompt_context`),
and each chunk of rows encoding only its own tokens on top of the stored keys/values (`context_logps_and_entropies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trl_grpo_ext.compat import cache_kwargs
from trl_grpo_ext.prefix.attention import kind_of, take
from trl_grpo_ext.prefix.layout import DEFAULT_MAX_PACKED_TOKENS, SegmentSpec, place
from trl_grpo_ext.prefix.packing import (
    PackedBatch,
    _has_holes,
    _kept_lengths,
    _unpack,
    choose_layout,
    fit_to,
    trl_tensors,
)
from trl_grpo_ext.prefix.plan import PrefixPlan, plan_prefix, prompts_from_left_padded
from trl_grpo_ext.prefix.support import _config_of, log_fallback_once


# Level 1 and 2 encoded once for many chunks of rows (a whole generation batch), each chunk then encoding only its
# rows' own tokens on top of the stored keys/values.
@dataclass
class PromptContext:
    """The shared prompt parts of a set of prompts, encoded once: the level-1 prefix and each distinct prompt's rest.

    Attributes:
        plan: the plan of the distinct prompts (`plan.groups[g]` is the g-th distinct prompt).
        group_of: prompt tokens -> group index.
        keys, values: per layer, (heads, slots, head_dim): every encoded slot, flattened (binned under eager:
            slot ``b * bin_length + t`` is bin b's slot t); gradients flow to the model through them.
        prefix_slots: per context bin, the slots of its copy of the level-1 prefix (one bin except under eager
            past `max_packed_tokens`).
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

    def prefix_range(self, group: int) -> tuple[int, int] | None:
        """(first slot, length) of the prefix copy `group` reads, or None without a prefix."""
        slots = self.prefix_slots[self.group_bin[group]]
        return (slots[0], len(slots)) if slots else None

    def rest_range(self, group: int) -> tuple[int, int] | None:
        slots = self.rest_slots[group]
        return (slots[0], len(slots)) if slots else None


def encode_prompt_context(
    model,
    prompts: Sequence[Sequence[int]],
    max_packed_tokens: int | None = None,
    pad_token_id: int = 0,
) -> PromptContext | None:
    """Encode the shared parts of `prompts` (token id lists, repeats allowed) once, keeping every layer's keys/values.

    Segments ``[level-1 prefix][rest of prompt g1][rest of prompt g2]...`` (under eager in bins, a new one with
    its own copy of the prefix when the next rest would push a bin past `max_packed_tokens`), each token at its
    position in its own prompt, a rest seeing the prefix and its own earlier tokens: the keys/values the plain
    forward computes for those tokens. Runs with gradients if they are enabled. ``None`` when there is nothing to
    encode (no common prefix and every prompt one token long) or the attention implementation can't run it.
    """
    from transformers import DynamicCache

    kind = kind_of(_config_of(model)._attn_implementation)
    distinct = list(dict.fromkeys(tuple(int(t) for t in p) for p in prompts))
    plan = plan_prefix(distinct)
    length = plan.prefix_length
    rests = [len(plan.remainder(g)) for g in range(len(plan.groups))]
    if kind is None or (not length and not any(rests)):
        return None
    binned = kind == "eager"
    limit = max_packed_tokens if max_packed_tokens is not None else (DEFAULT_MAX_PACKED_TOKENS if binned else None)
    device = next(model.parameters()).device
    ids, _, width = trl_tensors(plan.prompts, [()] * len(distinct), pad_token_id=pad_token_id, device=device)
    specs: list[SegmentSpec] = []
    prefix_spec, rest_spec, group_bin = [], [None] * len(rests), []
    size = 0
    for group, rest in enumerate(rests):
        p = len(plan.prompts[group])
        if not prefix_spec or (binned and limit is not None and size > length and size + rest > limit):
            size = length
            prefix_spec.append(len(specs) if length else None)
            if length:
                specs.append(SegmentSpec(group, width - p, length, 0, len(prefix_spec) - 1))
        group_bin.append(len(prefix_spec) - 1)
        if rest:
            rest_spec[group] = len(specs)
            specs.append(SegmentSpec(group, width - p + length, rest, length, group_bin[-1], prefix=prefix_spec[-1]))
        size += rest
    placement = place(specs, binned)
    cache = DynamicCache(config=_config_of(model))
    packed = fit_to(PackedBatch(placement, kind, [], (ids, None, pad_token_id)), model)
    model(**packed.forward_kwargs(model), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    flat = [(layer.keys, layer.values) for layer in cache.layers]
    keys = [k.transpose(0, 1).reshape(k.size(1), -1, k.size(3)) for k, _ in flat]
    values = [v.transpose(0, 1).reshape(v.size(1), -1, v.size(3)) for _, v in flat]

    def slots(spec):
        if spec is None:
            return []
        start = (placement.bins[spec] if binned else 0) * placement.length + placement.starts[spec]
        return list(range(start, start + specs[spec].length))

    return PromptContext(
        plan=plan,
        group_of={p: g for g, p in enumerate(plan.prompts)},
        keys=keys,
        values=values,
        prefix_slots=[slots(s) for s in prefix_spec],
        rest_slots=[slots(s) for s in rest_spec],
        group_bin=group_bin,
        tokens=sum(s.length for s in specs),
    )


def context_logps_and_entropies(
    model,
    context: PromptContext,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    max_packed_tokens: int | None = None,
    pad_token_id: int = 0,
    stats: dict | None = None,
):
    """`shared_prefix_logps_and_entropies` for rows whose shared prompt parts `context` holds: the forward encodes
    only each row's last prompt token and completion, attending to the stored keys/values.

    Rows are segments ``[row: last prompt token + completion]`` whose ancestor keys (their context bin's prefix,
    their prompt's rest) are stored context slots: under sdpa/flash/flex one concatenated stream reading the
    stored keys/values through `SegmentAttention`; under eager bins (a new one past `max_packed_tokens`, stored
    slots included) whose cache holds the context slots their rows read, gathered from ``context.keys/values``,
    under a dense mask. Each row sees its prompt's stored slots and its own earlier tokens: the attention the plain
    forward gives it. Returns ``(logps, entropies or None)`` of shape (rows, logits_to_keep), or ``None`` if a
    row's prompt is not in `context`, the layout isn't TRL's or can't run (the caller then shares per chunk or
    runs TRL's forward). `stats` as `shared_prefix_logps_and_entropies`' (the cost model is not asked: the stored
    parts are paid for, and the rows' own tokens cost no more than in TRL's padded rows).
    """
    kind = kind_of(_config_of(model)._attn_implementation)
    prompt_length = input_ids.size(1) - logits_to_keep
    prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
    if kind is None or prompts is None:
        return None
    groups = [context.group_of.get(tuple(p)) for p in prompts]
    if any(g is None for g in groups):
        return None
    kept = _kept_lengths(attention_mask, prompt_length)
    binned = kind == "eager"
    limit = max_packed_tokens if max_packed_tokens is not None else DEFAULT_MAX_PACKED_TOKENS
    specs, row_spec, stored = _row_segments(context, groups, prompts, kept, prompt_length, binned, limit)
    n_stored = max((sum(n for _, n in s) for s in stored), default=0)
    placement = place(specs, binned, n_stored if binned else int(context.keys[0].size(1)))
    holes = _has_holes(attention_mask, prompt_length, kept)
    if kind == "flash" and holes:
        log_fallback_once("flash-attention can't skip padding inside a completion (attention mask 0 before its end)")
        return None
    row_slots = [(placement.bins[i] if binned else 0, placement.starts[i], kept[r]) for r, i in enumerate(row_spec)]
    source = (input_ids, attention_mask, pad_token_id)
    if binned:
        packed = PackedBatch(placement, kind, row_slots, source, holes)
        cache = _binned_cache(context, stored, n_stored, input_ids.device) if n_stored else None
        kwargs = {**packed.forward_kwargs(model), **cache_kwargs(model, cache)}
    else:
        packed = fit_to(PackedBatch(placement, kind, row_slots, source, holes, context.keys, context.values), model)
        kwargs = packed.forward_kwargs(model)
    if stats is not None:
        choose_layout(model, packed, attention_mask, stats)
        stats["layout"] = "context"
    outputs = model(**kwargs, labels=packed.labels, fused_lm_head=True)
    logps = _unpack(outputs.log_probs, row_slots, logits_to_keep)
    entropies = _unpack(outputs.entropy, row_slots, logits_to_keep) if compute_entropy else None
    return logps, entropies


def _row_segments(
    context: PromptContext,
    groups: list[int],
    prompts: list,
    kept: list[int],
    prompt_length: int,
    binned: bool,
    limit: int,
) -> tuple[list[SegmentSpec], list[int], list[list[tuple[int, int]]]]:
    """`context_logps_and_entropies`' segments: one per row (its last prompt token and completion) reading its
    prompt's stored prefix and rest. Returns ``(specs in bin-major order, each row's spec, per bin the stored
    ranges its rows read)``; binned (eager), a new bin once the next row would push one past `limit`."""
    specs: list[SegmentSpec] = []
    row_spec = [0] * len(prompts)
    # binned: per bin the stored context ranges its rows read, in order ((first slot, length) each); a row's
    # ancestor ranges point into its bin's gathered stored slots
    stored: list[list[tuple[int, int]]] = []
    where: list[dict] = []
    own = 0
    for row in sorted(range(len(prompts)), key=lambda r: (groups[r], r)):
        group = groups[row]
        prefix, rest = context.prefix_range(group), context.rest_range(group)
        if not binned:
            specs.append(SegmentSpec(row, prompt_length - 1, 1 + kept[row], len(prompts[row]) - 1, 0, True,
                                     prefix, rest))  # fmt: skip
            row_spec[row] = len(specs) - 1
            continue
        new = [r for r in (prefix, rest) if r is not None and (not where or r not in where[-1])]
        cost = 1 + kept[row] + sum(n for _, n in new)
        if not stored or (own and sum(n for _, n in stored[-1]) + own + cost > limit):
            stored.append([])
            where.append({})
            own = 0
            new = [r for r in (prefix, rest) if r is not None]
        for r in new:
            where[-1][r] = sum(n for _, n in stored[-1])
            stored[-1].append(r)
        mapped = [None if r is None else (where[-1][r], r[1]) for r in (prefix, rest)]
        row_spec[row] = len(specs)
        specs.append(SegmentSpec(row, prompt_length - 1, 1 + kept[row], len(prompts[row]) - 1, len(stored) - 1,
                                 True, mapped[0], mapped[1]))  # fmt: skip
        own += 1 + kept[row]
    # segments must lie in bin-major order, as `place` lays them out
    order = sorted(range(len(specs)), key=lambda i: (specs[i].bin, i))
    position = {old: new for new, old in enumerate(order)}
    specs = [specs[i] for i in order]
    row_spec = [position[i] for i in row_spec]
    return specs, row_spec, stored


def _binned_cache(context: PromptContext, stored: list[list[tuple[int, int]]], n_stored: int, device):
    """Per bin, the stored context slots its rows read, gathered from ``context.keys/values`` into a cache."""
    from transformers import DynamicCache

    slot = torch.zeros((len(stored), n_stored), dtype=torch.long)
    for b, ranges in enumerate(stored):
        flat = torch.cat([torch.arange(start, start + n) for start, n in ranges])
        slot[b, : flat.numel()] = flat
    slot = slot.to(device)
    # (heads, slots, dim)[:, (bins, n_stored)] -> (bins, heads, n_stored, dim); autograd sums a slot's gradients
    # over the bins that read it (in bin order: `take`)
    return DynamicCache(
        ddp_cache_data=[
            (take(k, 1, slot).transpose(0, 1), take(v, 1, slot).transpose(0, 1))
            for k, v in zip(context.keys, context.values, strict=True)
        ]
    )
