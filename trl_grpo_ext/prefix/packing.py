"""One packed forward per batch: rows and their shared prompt parts in bins under a block mask (`pack_rows`), and
the training entry points on it (`shared_prefix_logps_and_entropies`, `shared_prefix_logits`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .plan import PrefixPlan, plan_prefix, prompts_from_left_padded
from .support import _config_of, log_fallback_once, sharing_unsupported_reason

# Packed sequence length above which rows go to another bin: attention over a packed row costs T^2, so very long
# packed rows would spend on attention what sharing saves in the feed-forward layers.
DEFAULT_MAX_PACKED_TOKENS = 4096


@dataclass
class PackedBatch:
    """A batch packed for one forward: ``input_ids``, ``position_ids``, ``labels`` (the token at each slot when it
    is scored, else -100) and ``visible`` (bins, 1, T, T) bool; ``row_slots[r]`` = (bin, first slot of row r's
    segment, number of scored positions)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    visible: torch.Tensor
    row_slots: list[tuple[int, int, int]]

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        if attn_implementation == "eager":
            zero = torch.zeros((), dtype=dtype, device=self.visible.device)
            return torch.where(self.visible, zero, torch.finfo(dtype).min)
        return self.visible


def pack_rows(
    plan: PrefixPlan,
    completions: Sequence[Sequence[int]],
    completion_masks: Sequence[Sequence[bool]] | None = None,
    max_packed_tokens: int = DEFAULT_MAX_PACKED_TOKENS,
    pad_token_id: int = 0,
    device=None,
) -> PackedBatch:
    """Pack `plan`'s rows and their `completions` (scored tokens after each prompt) into bins of shared layout.

    ``completion_masks[r][j]`` false marks a completion slot as padding: no token attends to it and it is not scored,
    as TRL's attention mask does. A bin holds the level-1 prefix, then rows in group order, each group's rest of
    prompt once before its first row; a new bin starts when the next row would push the bin past `max_packed_tokens`.
    """
    n_rows = len(plan.prompts)
    if len(completions) != n_rows:
        raise ValueError(f"{len(completions)} completions for {n_rows} prompts")
    prefix = list(plan.prompts[0][: plan.prefix_length])
    # one bin: lists of (token, position, group, row, key_valid, label) per slot
    bins: list[list[tuple[int, int, int, int, bool, int]]] = []
    row_slots: list[tuple[int, int, int] | None] = [None] * n_rows
    current: list | None = None
    in_bin: set[int] = set()

    def new_bin():
        slots = [(tok, pos, -1, -1, True, -100) for pos, tok in enumerate(prefix)]
        bins.append(slots)
        in_bin.clear()
        return slots

    for group, rows in enumerate(plan.groups):
        rest = plan.remainder(group)
        for row in rows:
            prompt = plan.prompts[row]
            completion = [int(t) for t in completions[row]]
            mask = [True] * len(completion) if completion_masks is None else [bool(m) for m in completion_masks[row]]
            cost = 1 + len(completion) + (0 if group in in_bin else len(rest))
            if current is None or (len(current) > len(prefix) and len(current) + cost > max_packed_tokens):
                current = new_bin()
            if group not in in_bin:
                start = plan.prefix_length
                current.extend((tok, start + i, group, -1, True, -100) for i, tok in enumerate(rest))
                in_bin.add(group)
            first = len(current)
            base = len(prompt) - 1
            current.append((prompt[-1], base, group, row, True, -100))
            for j, (tok, valid) in enumerate(zip(completion, mask, strict=True)):
                current.append((tok, base + 1 + j, group, row, valid, tok if valid else -100))
            row_slots[row] = (len(bins) - 1, first, len(completion))

    length = max(len(b) for b in bins)
    n_bins = len(bins)
    ids = torch.full((n_bins, length), pad_token_id, dtype=torch.long)
    pos = torch.zeros((n_bins, length), dtype=torch.long)
    group_of = torch.full((n_bins, length), -2, dtype=torch.long)
    row_of = torch.full((n_bins, length), -2, dtype=torch.long)
    valid = torch.zeros((n_bins, length), dtype=torch.bool)
    labels = torch.full((n_bins, length), -100, dtype=torch.long)
    for b, slots in enumerate(bins):
        if not slots:
            continue
        tok, p, g, r, v, lab = zip(*slots, strict=True)
        n = len(slots)
        ids[b, :n] = torch.tensor(tok)
        pos[b, :n] = torch.tensor(p)
        group_of[b, :n] = torch.tensor(g)
        row_of[b, :n] = torch.tensor(r)
        valid[b, :n] = torch.tensor(v)
        labels[b, :n] = torch.tensor(lab)
    # query q sees key k iff k <= q, k is not padding, and k is the shared prefix, or k is q's prompt rest, or k is
    # in q's own row
    gq, gk = group_of.unsqueeze(2), group_of.unsqueeze(1)
    rq, rk = row_of.unsqueeze(2), row_of.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = (gk == -1) | ((gk == gq) & ((rk == -1) | (rk == rq)))
    visible = causal & same & valid.unsqueeze(1)
    # unused tail slots of shorter bins see themselves only (a query with no key would give NaN)
    visible |= torch.eye(length, dtype=torch.bool) & (group_of == -2).unsqueeze(2)
    return PackedBatch(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        labels=labels.to(device),
        visible=visible.unsqueeze(1).to(device),
        row_slots=row_slots,
    )


def _packed_forward_kwargs(model, packed: PackedBatch) -> dict:
    config = _config_of(model)
    dtype = next(model.parameters()).dtype
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "attention_mask": packed.attention_mask(config._attn_implementation, dtype),
    }


def _unpack(values: torch.Tensor, row_slots: Sequence[tuple[int, int, int]], width: int) -> torch.Tensor:
    """(bins, T) per-slot values -> (rows, width): row r's value predicting its j-th completion token at [r, j]
    (zero past the row's completion), from the slot before that token; ``row_slots`` as `PackedBatch`'s."""
    index = torch.zeros((len(row_slots), width), dtype=torch.long, device=values.device)
    keep = torch.zeros((len(row_slots), width), dtype=torch.bool, device=values.device)
    bin_of = torch.zeros(len(row_slots), dtype=torch.long, device=values.device)
    for row, (b, first, n) in enumerate(row_slots):
        n = min(n, width)
        index[row, :n] = torch.arange(first, first + n)
        keep[row, :n] = True
        bin_of[row] = b
    gathered = values[bin_of.unsqueeze(1), index]
    return gathered.masked_fill(~keep, 0)


# ---------------------------------------------------------------------------------------------------------- training
def _completions(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int):
    """Each row's completion tokens and their mask from TRL's layout, trailing padding left out (it is never
    attended to nor scored)."""
    completion_mask = attention_mask[:, prompt_length:].bool()
    kept = torch.where(completion_mask.any(1), completion_mask.size(1) - completion_mask.flip(1).int().argmax(1), 0)
    ids, masks = input_ids[:, prompt_length:].tolist(), completion_mask.tolist()
    completions = [row[:n] for row, n in zip(ids, kept.tolist(), strict=True)]
    completion_masks = [row[:n] for row, n in zip(masks, kept.tolist(), strict=True)]
    return completions, completion_masks


def shared_prefix_logps_and_entropies(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    max_packed_tokens: int = DEFAULT_MAX_PACKED_TOKENS,
    pad_token_id: int = 0,
    plan: PrefixPlan | None = None,
):
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens, TRL's layout, from one shared encoding.

    Same inputs and outputs as TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` for one chunk:
    ``input_ids``/``attention_mask`` are left-padded prompts followed by completions (mask 0 after EOS), and the
    model carries TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`), which applies the temperature. Tokens
    whose attention mask is 0 score 0, as in TRL. Returns ``(logps, entropies or None)`` of shape
    (rows, logits_to_keep), or ``None`` when the rows share nothing or the layout isn't TRL's (the caller then runs
    the plain forward).
    """
    prompt_length = input_ids.size(1) - logits_to_keep
    if plan is None:
        prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
        if prompts is None:
            log_fallback_once("a prompt is empty or not left-padded")
            return None
        plan = plan_prefix(prompts)
    if not plan.shares:
        return None
    completions, completion_masks = _completions(input_ids, attention_mask, prompt_length)
    packed = pack_rows(plan, completions, completion_masks, max_packed_tokens, pad_token_id, input_ids.device)
    outputs = model(**_packed_forward_kwargs(model, packed), labels=packed.labels, fused_lm_head=True)
    # log_probs[:, t] scores the token in slot t + 1 (from hidden state t): completion token j of a row whose
    # segment starts at slot s (its last prompt token) is at t = s + j
    logps = _unpack(outputs.log_probs, packed.row_slots, logits_to_keep)
    entropies = _unpack(outputs.entropy, packed.row_slots, logits_to_keep) if compute_entropy else None
    return logps, entropies


def shared_prefix_logits(
    model,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    max_packed_tokens: int = DEFAULT_MAX_PACKED_TOKENS,
    pad_token_id: int = 0,
) -> list[torch.Tensor]:
    """Next-token logits for each row's completion from one shared encoding of the rows' prompts.

    ``result[r][j]`` (vocab,) are the logits that score ``completions[r][j]`` given ``prompts[r] +
    completions[r][:j]``, as ``model(prompts[r] + completions[r]).logits[len(prompts[r]) - 1 + j]`` would give
    them. Rows need not be padded or grouped; gradients flow to the model. Raises ``ValueError`` where
    `sharing_unsupported_reason` gives a reason (check it first to fall back).
    """
    reason = sharing_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"shared_prefix_logits: {reason}")
    plan = plan_prefix(prompts)
    device = next(model.parameters()).device
    packed = pack_rows(plan, completions, None, max_packed_tokens, pad_token_id, device)
    logits = model(**_packed_forward_kwargs(model, packed)).logits
    return [logits[b, first : first + n] for b, first, n in packed.row_slots]
