"""One packed forward per chunk of rows: the rows and their shared prompt parts as segments (`pack_chunk`), the
cost model's choice between that and padded rows, and the entry points on it: the TRL trainer's
(`shared_prefix_logps_and_entropies`) and the local PyTRIO server's (`pack_rows`, then `PackedBatch.row_reads`:
where every position of every row, shared ones included, lies in the forward's output)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trl_grpo_ext.prefix.attention import BUCKET_OVERHEAD_PAIRS, SegmentAttention, install, kind_of, placeholder_mask
from trl_grpo_ext.prefix.cost import ModelCost, layout_cost, packed_is_cheaper, padded_pairs
from trl_grpo_ext.prefix.layout import (
    DEFAULT_MAX_PACKED_TOKENS,
    Placement,
    SegmentSpec,
    Stream,
    build_stream,
    dense_visibility,
    eager_mask,
    place,
)
from trl_grpo_ext.prefix.plan import PrefixPlan, plan_prefix, prompts_from_left_padded
from trl_grpo_ext.prefix.support import _config_of, log_fallback_once


@dataclass(eq=False)
class PackedBatch:
    """A chunk packed for one forward: where its segments lie (``placement``, host only), how attention runs
    (``kind``: ``"eager"`` binned under a dense mask, else concatenated through `SegmentAttention`), and
    ``row_slots[r]`` = (bin, first slot of row r's segment, number of scored positions), ``row_specs[r]`` the
    index of row r's segment in ``placement.specs``. The tensors (`stream`:
    ``input_ids``, ``position_ids``, ``labels``, ...) are gathered from ``source`` (TRL's padded ids and mask) on
    first use, so the cost model can reject the layout before anything is built."""

    placement: Placement
    kind: str
    row_slots: list[tuple[int, int, int]]
    source: tuple[torch.Tensor, torch.Tensor | None, int]
    holes: bool = False
    context_keys: list[torch.Tensor] | None = None
    context_values: list[torch.Tensor] | None = None
    call_overhead: int = BUCKET_OVERHEAD_PAIRS
    row_specs: tuple[int, ...] = ()
    _stream: Stream | None = None
    _attention: SegmentAttention | None = None

    @property
    def stream(self) -> Stream:
        if self._stream is None:
            self._stream = build_stream(self.placement, *self.source)
        return self._stream

    @property
    def input_ids(self) -> torch.Tensor:
        return self.stream.input_ids

    @property
    def position_ids(self) -> torch.Tensor:
        return self.stream.position_ids

    @property
    def labels(self) -> torch.Tensor:
        return self.stream.labels

    @property
    def binned(self) -> bool:
        return self.placement.binned

    @property
    def visible(self) -> torch.Tensor:
        """(batch, 1, T, context + T) bool: which slot sees which key (the binned layout's dense mask)."""
        s, p = self.stream, self.placement
        key_valid = s.valid
        if p.context_length:
            key_valid = torch.cat([s.valid.new_ones(p.rows, p.context_length), key_valid], dim=1)
        return dense_visibility(s.segment, s.ranges, p.context_length + p.length, p.context_length, key_valid)

    def attention(self) -> SegmentAttention:
        """The concatenated layout's `SegmentAttention` (sizes only until its tensors are first needed)."""
        if self._attention is None:
            p = self.placement
            self._attention = SegmentAttention(
                ranges_host=p.ranges_host,
                query_start=p.starts,
                stream_length=p.length,
                kind=self.kind,
                device=self.source[0].device,
                context_length=p.context_length,
                holes=self.holes,
                call_overhead=self.call_overhead,
                context_keys=self.context_keys,
                context_values=self.context_values,
            )
        return self._attention

    def row_reads(self, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Where position j of row r (its prompt then completion; ``lengths[r]`` tokens) lies in the forward's
        output flattened to (bins * T,): ``slot[r, j]``, and which of that slot's readers row r is: ``reader[r, j]``
        (each shared slot is read by every row attending to it, a row's own slots by the row only), as
        (rows, max(lengths)) tensors (0 past a row's end); and the most readers of one slot.

        One output per slot serves all its readers: the local server scores each row's own target at a shared
        position from the one encoding of that position (`plan.plan_token_rows` rows).
        """
        p = self.placement
        offset = [(b if p.binned else 0) * p.length + start for b, start in zip(p.bins, p.starts, strict=True)]
        readers: dict[int, int] = {}
        table = []  # per row: prefix slot, its length, rank among its readers; the same for the rest; own slot
        for r in self.row_specs:
            spec, row = p.specs[r], []
            for ref in (spec.prefix, spec.rest):
                if ref is None:
                    row += [0, 0, 0]
                    continue
                if not isinstance(ref, int):
                    raise ValueError("row_reads needs the shared parts in the stream, not in a stored context")
                rank = readers[ref] = readers.get(ref, -1) + 1
                row += [offset[ref], p.specs[ref].length, rank]
            table.append(row + [offset[r]])
        device = self.source[0].device
        t = torch.tensor(table, dtype=torch.long).reshape(-1, 7).to(device).unsqueeze(-1).unbind(1)
        prefix, prefix_len, prefix_rank, rest, rest_len, rest_rank, own = t
        width = max(lengths, default=0)
        j = torch.arange(width, device=device).unsqueeze(0)
        in_prefix, in_rest = j < prefix_len, j < prefix_len + rest_len
        slot = torch.where(
            in_prefix, prefix + j, torch.where(in_rest, rest + j - prefix_len, own + j - prefix_len - rest_len)
        )
        reader = torch.where(in_prefix, prefix_rank, torch.where(in_rest, rest_rank, 0))
        inside = j < torch.tensor(list(lengths), dtype=torch.long, device=device).unsqueeze(1)
        return torch.where(inside, slot, 0), torch.where(inside, reader, 0), 1 + max(readers.values(), default=0)

    def attention_pairs(self) -> int:
        p = self.placement
        if self.binned:
            return p.rows * p.length * (p.context_length + p.length)
        return self.attention().attention_pairs()

    def forward_kwargs(self, model) -> dict:
        """``input_ids``, ``position_ids`` and how attention sees the layout, for ``model(...)``."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.binned:
            visible = self.visible
            if _config_of(model)._attn_implementation == "eager":
                visible = eager_mask(visible, next(model.parameters()).dtype)
            kwargs["attention_mask"] = visible
            return kwargs
        install()
        attention = self.attention()
        if self.holes and attention.key_valid is None:
            attention.key_valid = self.stream.valid[0]
            if attention.context_length:
                attention.key_valid = torch.cat([self.stream.valid.new_ones(attention.context_length),
                                                 attention.key_valid])  # fmt: skip
        kwargs["attention_mask"] = placeholder_mask(self.input_ids.device)
        kwargs["prefix_attention"] = attention.prepare()
        return kwargs


def pack_chunk(
    plan: PrefixPlan,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_width: int,
    kept: Sequence[int],
    kind: str,
    max_packed_tokens: int | None = None,
    pad_token_id: int = 0,
    holes: bool | None = None,
) -> PackedBatch:
    """Pack `plan`'s rows from TRL's layout (``input_ids`` (rows, prompt_width + completion width), prompts
    left-padded to `prompt_width`) with the first ``kept[r]`` completion tokens of each row.

    Bins (a new one, with its own copy of the prefix, when the next row would push the current past
    `max_packed_tokens`; default `DEFAULT_MAX_PACKED_TOKENS` under eager, unlimited otherwise) hold ``[prefix]``,
    then per group its rest (once) and its rows: ``[row: last prompt token + completion]``. Completion slots whose
    mask is 0 are nobody's key and not scored, as under TRL's attention mask (`holes`: whether any lies before
    a row's end; worked out from the mask when not given).
    """
    binned = kind == "eager"
    limit = max_packed_tokens if max_packed_tokens is not None else (DEFAULT_MAX_PACKED_TOKENS if binned else None)
    length = plan.prefix_length
    specs: list[SegmentSpec] = []
    row_spec = [0] * len(plan.prompts)
    current, size, prefix, rests = -1, 0, None, {}
    for group, rows in enumerate(plan.groups):
        rest = len(plan.prompts[rows[0]]) - 1 - length
        for row in rows:
            p = len(plan.prompts[row])
            cost = 1 + kept[row] + (0 if group in rests else rest)
            if current < 0 or (limit is not None and size > length and size + cost > limit):
                current, size, rests = current + 1, length, {}
                prefix = None
                if length:
                    prefix = len(specs)
                    specs.append(SegmentSpec(row, prompt_width - p, length, 0, current))
            if group not in rests:
                rests[group] = None
                if rest:
                    rests[group] = len(specs)
                    specs.append(SegmentSpec(row, prompt_width - p + length, rest, length, current, prefix=prefix))
            row_spec[row] = len(specs)
            specs.append(SegmentSpec(row, prompt_width - 1, 1 + kept[row], p - 1, current, True, prefix, rests[group]))
            size += cost
    placement = place(specs, binned)
    if holes is None:
        holes = attention_mask is not None and _has_holes(attention_mask, prompt_width, kept)
    row_slots = [(placement.bins[i] if binned else 0, placement.starts[i], kept[r]) for r, i in enumerate(row_spec)]
    source = (input_ids, attention_mask, pad_token_id)
    return PackedBatch(placement, kind, row_slots, source, holes, row_specs=tuple(row_spec))


def _has_holes(attention_mask: torch.Tensor, prompt_width: int, kept: Sequence[int]) -> bool:
    """Whether a completion has mask 0 before its last unmasked token."""
    return int(attention_mask[:, prompt_width:].sum()) != sum(kept)


def _unpack(values: torch.Tensor, row_slots: Sequence[tuple[int, int, int]], width: int) -> torch.Tensor:
    """(bins, T) per-slot values -> (rows, width): row r's value predicting its j-th completion token at [r, j]
    (zero past the row's completion), from the slot before that token; ``row_slots`` as `PackedBatch`'s."""
    slots = torch.tensor(row_slots, dtype=torch.long).to(values.device)
    j = torch.arange(width, device=values.device).unsqueeze(0)
    keep = j < slots[:, 2:3]
    column = torch.where(keep, slots[:, 1:2] + j, 0)
    return values[slots[:, 0:1], column].masked_fill(~keep, 0)


# ---------------------------------------------------------------------------------------------------------- training
def _kept_lengths(attention_mask: torch.Tensor, prompt_length: int) -> list[int]:
    """Each row's completion length without its trailing padding (never attended to nor scored)."""
    completion_mask = attention_mask[:, prompt_length:].bool()
    width = completion_mask.size(1)
    return torch.where(completion_mask.any(1), width - completion_mask.flip(1).int().argmax(1), 0).tolist()


def _every_position_scored(device: torch.device) -> bool:
    # TRL's fused head scores only labelled positions with Triton (CUDA/XPU), every position elsewhere
    return device.type not in ("cuda", "xpu")


def fit_to(packed: PackedBatch, model) -> PackedBatch:
    """Set `packed`'s per-call overhead (bucket planning) for `model` on its device."""
    packed.call_overhead = ModelCost.of(_config_of(model)).call_overhead_pairs(packed.source[0].device)
    packed._attention = None  # its bucket plan depends on the overhead
    return packed


def choose_layout(model, packed: PackedBatch, attention_mask: torch.Tensor, stats: dict | None = None) -> bool:
    """Whether `packed` beats TRL's padded rows (``attention_mask``: their mask) by the cost model; fills `stats`
    (``tokens``, ``padded_tokens``, ``packed_cost``, ``padded_cost``) when given."""
    scored = _every_position_scored(attention_mask.device)
    return packed_beats_padded(model, packed, attention_mask.sum(1).tolist(), attention_mask.size(1), scored, stats)


def packed_beats_padded(
    model,
    packed: PackedBatch,
    lengths: Sequence[int],
    width: int,
    every_position_scored: bool,
    stats: dict | None = None,
) -> bool:
    """Whether `packed` beats padded rows of `width` slots holding `lengths` real tokens each, by the cost model
    (`cost`); `every_position_scored`: the LM head runs on every slot of either layout. `stats` as
    `choose_layout`'s."""
    cost = ModelCost.of(_config_of(model))
    scored = every_position_scored
    rows = len(lengths)
    pairs = padded_pairs(packed.kind, lengths, width, any(n < width for n in lengths))
    padded_cost = layout_cost(cost, rows * width, pairs, 0, scored)
    gathered = 0 if packed.binned else packed.attention().gathered_slots()
    tokens = packed.placement.tokens
    packed_cost = layout_cost(cost, tokens, packed.attention_pairs(), gathered, scored)
    if stats is not None:
        stats.update(tokens=tokens, padded_tokens=rows * width)
        stats.update(packed_cost=packed_cost, padded_cost=padded_cost)
    return packed_is_cheaper(packed_cost, padded_cost)


def shared_prefix_logps_and_entropies(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    max_packed_tokens: int | None = None,
    pad_token_id: int = 0,
    plan: PrefixPlan | None = None,
    layout: str = "auto",
    stats: dict | None = None,
):
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens, TRL's layout, from one packed forward.

    Same inputs and outputs as TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` for one chunk:
    ``input_ids``/``attention_mask`` are left-padded prompts followed by completions (mask 0 after EOS), and the
    model carries TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`), which applies the temperature. Tokens
    whose attention mask is 0 score 0, as in TRL. Returns ``(logps, entropies or None)`` of shape
    (rows, logits_to_keep), or ``None`` when the caller should run TRL's padded forward: the rows share nothing, the
    layout isn't TRL's, the attention implementation can't run the layout, or (``layout="auto"``) the cost model
    finds TRL's padded rows cheaper (``layout="packed"`` skips that check). `stats`, when given, gets the
    cost model's figures and ``layout`` (``"packed"`` or ``"padded"``).
    """
    if layout not in ("auto", "packed"):
        raise ValueError(f"layout={layout!r} must be 'auto' or 'packed'")
    kind = kind_of(_config_of(model)._attn_implementation)
    if kind is None:
        return None
    prompt_length = input_ids.size(1) - logits_to_keep
    if plan is None:
        prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
        if prompts is None:
            log_fallback_once("a prompt is empty or not left-padded")
            return None
        plan = plan_prefix(prompts)
    if not plan.shares:
        return None
    kept = _kept_lengths(attention_mask, prompt_length)
    packed = pack_chunk(plan, input_ids, attention_mask, prompt_length, kept, kind, max_packed_tokens, pad_token_id)
    fit_to(packed, model)
    if kind == "flash" and packed.holes:
        log_fallback_once("flash-attention can't skip padding inside a completion (attention mask 0 before its end)")
        return None
    cheaper = choose_layout(model, packed, attention_mask, stats)
    if stats is not None:
        stats["layout"] = "packed" if cheaper or layout == "packed" else "padded"
    if layout == "auto" and not cheaper:
        return None
    outputs = model(**packed.forward_kwargs(model), labels=packed.labels, fused_lm_head=True)
    # log_probs[:, t] scores the token in slot t + 1 (from hidden state t): completion token j of a row whose
    # segment starts at slot s (its last prompt token) is at t = s + j
    logps = _unpack(outputs.log_probs, packed.row_slots, logits_to_keep)
    entropies = _unpack(outputs.entropy, packed.row_slots, logits_to_keep) if compute_entropy else None
    return logps, entropies


def trl_tensors(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    completion_masks: Sequence[Sequence[bool]] | None = None,
    pad_token_id: int = 0,
    device=None,
):
    """TRL's layout of token lists: ``(input_ids, attention_mask, prompt_width)``, prompts left-padded, completions
    right-padded (mask 0 where ``completion_masks`` says so)."""
    prompt_width = max(len(p) for p in prompts)
    width = prompt_width + max((len(c) for c in completions), default=0)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if prompt:
            ids[i, prompt_width - len(prompt) : prompt_width] = torch.tensor(list(prompt), dtype=torch.long)
            mask[i, prompt_width - len(prompt) : prompt_width] = True
        if completion:
            ids[i, prompt_width : prompt_width + len(completion)] = torch.tensor(list(completion), dtype=torch.long)
            valid = [True] * len(completion) if completion_masks is None else [bool(m) for m in completion_masks[i]]
            mask[i, prompt_width : prompt_width + len(completion)] = torch.tensor(valid)
    return ids.to(device), mask.to(device), prompt_width


def pack_rows(
    plan: PrefixPlan,
    completions: Sequence[Sequence[int]],
    completion_masks: Sequence[Sequence[bool]] | None = None,
    max_packed_tokens: int | None = None,
    pad_token_id: int = 0,
    device=None,
    attn_implementation: str = "eager",
) -> PackedBatch:
    """`pack_chunk` of `plan`'s rows and their `completions` (token lists; ``completion_masks[r][j]`` false marks
    a padded completion slot), laid out for `attn_implementation` (eager: bins, else one concatenated stream)."""
    if len(completions) != len(plan.prompts):
        raise ValueError(f"{len(completions)} completions for {len(plan.prompts)} prompts")
    kind = kind_of(attn_implementation)
    if kind is None:
        raise ValueError(f"attention implementation {attn_implementation!r} can't run a packed layout")
    ids, mask, width = trl_tensors(plan.prompts, completions, completion_masks, pad_token_id, device)
    kept = [len(c) for c in completions]
    return pack_chunk(plan, ids, mask, width, kept, kind, max_packed_tokens, pad_token_id)
