"""Shared-prefix computation: every prompt token encoded once per generation batch, in training and in generation.

A GRPO batch repeats each prompt ``num_generations`` times, and all prompts usually start with the same tokens (chat
template, system prompt, one-shot example). Two sharing levels (after Prefix Grouper, arXiv 2506.05433, which has
the second one only):

- level 1: the longest token prefix common to every row of the batch;
- level 2: the rest of each *distinct* prompt (rows with the same prompt form a group; they need not be adjacent).

Training (`shared_prefix_logps_and_entropies`, `shared_prefix_logits`) packs a batch into one sequence per "bin"::

    [level-1 prefix][rest of prompt g1][rest of prompt g2]...[row 1: last prompt token + completion][row 2: ...]...

with explicit ``position_ids`` (each token keeps the position it has in its own row) and a 4D attention mask under
which a row's tokens see the level-1 prefix, their own prompt's rest and their own earlier tokens only. That is the
attention each row has in the plain forward, so outputs equal the plain forward's to float rounding; gradients flow
through the shared encodings as sums over the rows that read them. One ordinary forward: gradient checkpointing, LoRA
and TRL's fused LM head work unchanged. The last prompt token is part of each row's segment because its hidden state
scores the first completion token.

Across chunks (`encode_prompt_context`, `context_logps_and_entropies`): the shared parts of a whole generation batch
are encoded once, keeping every layer's keys/values, and each chunk of rows (a micro-batch, or ``batch_size`` rows of
a no-grad log-prob call) encodes only its rows' own tokens on top of them through a cache and the same kind of mask.
In training the context is encoded with gradients once per accumulation cycle; `PrefixSharingMixin` gives the
micro-batches detached leaf copies and sends their accumulated gradient through the context once, after the cycle's
last backward.

Generation (`shared_prefix_generate`) encodes the level-1 prefix once, each distinct prompt's rest once on top of it,
expands the `DynamicCache` to the rows and hands it to ``model.generate``, which decodes as usual (greedy, sampling,
logits processors, stopping criteria are all its own).

Sharing applies only where it is exact (`sharing_unsupported_reason`); elsewhere callers use the plain path.
`docs/prefix_sharing.md` lists the conditions.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Attention implementations that take a custom 4D mask as given (bool for sdpa, additive float for eager).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Decoder families with standard RoPE on explicit position_ids and one full-attention mask for every layer.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "phi3", "smollm3")
# RoPE variants whose frequencies don't depend on the sequence length ("dynamic" and "longrope" do).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Packed sequence length above which rows go to another bin: attention over a packed row costs T^2, so very long
# packed rows would spend on attention what sharing saves in the feed-forward layers.
DEFAULT_MAX_PACKED_TOKENS = 4096

_LOGGED: set[str] = set()


def log_fallback_once(reason: str) -> None:
    """Log (once per process and reason) why the plain path is used."""
    log_prefix_once(f"prompt-prefix sharing not applied, plain forward used: {reason}")


def log_prefix_once(message: str) -> None:
    """Log `message` once per process."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning("%s", message)


# ---------------------------------------------------------------------------------------------------------- plan
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
    prompts = tuple(tuple(int(t) for t in p) for p in prompts)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("plan_prefix needs at least one row and a non-empty prompt in every row")
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    length = 0
    while length < limit and all(p[length] == first[length] for p in prompts):
        length += 1
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


# ---------------------------------------------------------------------------------------------------------- support
def _unwrap(model):
    """The model inside DDP-style wrappers (``.module``); a PEFT model stays itself."""
    inner = model
    for _ in range(4):
        if hasattr(inner, "module") and not hasattr(inner, "config"):
            inner = inner.module
    return inner


def _config_of(model):
    """The text config of a (possibly PEFT- or DDP-wrapped) model."""
    config = getattr(_unwrap(model), "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sharing_unsupported_reason(model) -> str | None:
    """Why a packed/shared forward would not reproduce `model`'s plain forward exactly, or ``None`` if it would."""
    config = _config_of(model)
    if config is None:
        return f"{type(model).__name__} has no config"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        return f"attention implementation {attn!r} does not take a custom 4D mask (use sdpa or eager)"
    layer_types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if (layer_types and any(t != "full_attention" for t in layer_types)) or sliding is not None:
        return "sliding-window layers need their own mask"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} depends on the sequence length"
    inner = _unwrap(model)
    peft_config = getattr(inner, "active_peft_config", None) if hasattr(inner, "peft_config") else None
    if getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning PEFT adapters prepend virtual tokens to every row"
    return None


# ---------------------------------------------------------------------------------------------------------- packing
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


# ---------------------------------------------------------------------------------------------------------- context
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
          cache=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
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
        cache=cache,
        labels=labels.to(device),
        fused_lm_head=True,
    )
    logps = _unpack(outputs.log_probs, row_slots, logits_to_keep)
    entropies = _unpack(outputs.entropy, row_slots, logits_to_keep) if compute_entropy else None
    return logps, entropies


# ---------------------------------------------------------------------------------------------------------- generation
def _left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, pad_to_multiple_of: int | None, device):
    length = max(len(p) for p in prompts)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, length - len(p) :] = torch.tensor(list(p))
            mask[i, length - len(p) :] = 1
    return ids.to(device), mask.to(device)


def generation_unsupported_reason(model, generation_config=None) -> str | None:
    """Why `shared_prefix_generate` would not decode what ``model.generate`` decodes, or ``None``."""
    reason = sharing_unsupported_reason(model)
    if reason is not None:
        return reason
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if config is not None:
        if (getattr(config, "num_beams", 1) or 1) != 1 or (getattr(config, "num_return_sequences", 1) or 1) != 1:
            return "beam search / num_return_sequences > 1 expand the batch inside generate"
        if getattr(config, "prompt_lookup_num_tokens", None) or getattr(config, "assistant_model", None):
            return "assisted decoding re-encodes the prompt"
        if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
            return f"cache_implementation {config.cache_implementation!r} is not a DynamicCache"
        # processors that read the whole input row (its padding, adjacency or length), which the shared layout changes
        if (getattr(config, "repetition_penalty", None) or 1.0) != 1.0:
            return "repetition_penalty reads the padded prompt"
        for name in ("no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length"):
            if getattr(config, name, None):
                return f"{name} reads the padded prompt"
        if getattr(config, "max_new_tokens", None) is None:
            return "max_length without max_new_tokens counts the padded prompt"
    return None


@torch.no_grad()
def shared_prefix_generate(
    model,
    prompts: Sequence[Sequence[int]],
    pad_token_id: int,
    generation_config=None,
    pad_to_multiple_of: int | None = None,
    **generate_kwargs,
) -> torch.Tensor:
    """``model.generate`` of `prompts` (token id lists) with each shared prompt token encoded once.

    Returns what ``model.generate(input_ids=left_padded, attention_mask=...)`` returns: (rows, P + new) with the
    prompts left-padded to P (a multiple of `pad_to_multiple_of` if given) and the generated tokens after them (as
    ``.sequences`` with ``return_dict_in_generate``; its scores/logits are per step, as generate's).
    The level-1 prefix is encoded once, each distinct prompt's rest once on top of it, the cache is expanded to the
    rows, and ``generate`` continues from the last prompt token with its own decoding loop, so greedy decoding
    gives the same tokens and sampling the same per-step logits (to float rounding) for the same seed. Falls back to
    the plain ``generate`` (logging why once) where that would not hold or nothing is shared.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    padded, padded_mask = _left_pad(prompts, pad_token_id, pad_to_multiple_of, device)
    # the settings generate will use: the given (or the model's) config updated with the keyword arguments
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    kwargs = {"generation_config": config, **config.update(**generate_kwargs)}
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id  # what generate pads finished rows with
    reason = generation_unsupported_reason(model, config)
    plan = plan_prefix(prompts) if all(len(p) > 0 for p in prompts) else None
    if reason is None and plan is None:
        reason = "an empty prompt"
    if (
        reason is None
        and plan.prefix_length == 0
        and any(len(plan.remainder(g)) == 0 for g in range(len(plan.groups)))
    ):
        reason = "one-token prompts with no common prefix"  # their rest-of-prompt rows would have no key at all
    if reason is not None:
        log_fallback_once(reason)
    if reason is not None or not plan.shares:
        return model.generate(input_ids=padded, attention_mask=padded_mask, **kwargs)

    cache = DynamicCache(config=_config_of(model))
    length = plan.prefix_length
    if length:
        prefix = torch.tensor([list(plan.prompts[0][:length])], device=device)
        model(input_ids=prefix, position_ids=torch.arange(length, device=device)[None], cache=cache, use_cache=True,
              logits_to_keep=1)  # fmt: skip
    rests = [plan.remainder(g) for g in range(len(plan.groups))]
    width = max(len(r) for r in rests)
    rest_ids = torch.full((len(rests), width), pad_token_id, dtype=torch.long, device=device)
    rest_mask = torch.zeros((len(rests), width), dtype=torch.long, device=device)
    for g, rest in enumerate(rests):
        rest_ids[g, : len(rest)] = torch.tensor(rest, dtype=torch.long)
        rest_mask[g, : len(rest)] = 1
    if width:
        if length:
            cache.reorder_cache(torch.zeros(len(rests), dtype=torch.long, device=device))
        mask = torch.cat([torch.ones(len(rests), length, dtype=torch.long, device=device), rest_mask], dim=1)
        positions = (length + torch.arange(width, device=device)).expand(len(rests), -1)
        model(input_ids=rest_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
              logits_to_keep=1)  # fmt: skip
        cache.reorder_cache(torch.tensor(plan.row_group, dtype=torch.long, device=device))
    else:
        cache.reorder_cache(torch.zeros(len(plan.prompts), dtype=torch.long, device=device))
    # generate's inputs: the cached slots (holes where a prompt's rest is shorter than the longest) then the last
    # prompt token; generate derives positions from the mask's cumulative sum, i.e. each row's own positions
    rows = torch.tensor(plan.row_group, dtype=torch.long, device=device)
    last = torch.tensor([[p[-1]] for p in plan.prompts], dtype=torch.long, device=device)
    head = torch.tensor([list(plan.prompts[0][:length])] * len(plan.prompts), dtype=torch.long, device=device)
    head = head.reshape(len(plan.prompts), length)
    ids = torch.cat([head, rest_ids[rows], last], dim=1)
    mask = torch.cat([torch.ones_like(head), rest_mask[rows], torch.ones_like(last)], dim=1)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)
    if isinstance(out, torch.Tensor):
        return torch.cat([padded, out[:, ids.size(1) :]], dim=1)
    out.sequences = torch.cat([padded, out.sequences[:, ids.size(1) :]], dim=1)  # return_dict_in_generate
    return out


# ---------------------------------------------------------------------------------------------------------- trainer
@dataclass
class _Cycle:
    """The prompt context of one gradient-accumulation cycle: `context` holds the graph-attached keys/values, the
    micro-batches read detached leaf copies of them (``leaves``), whose ``.grad`` accumulates over the cycle's
    backward calls until `PrefixSharingMixin._flush_prefix_cycle` sends it through the graph once."""

    model: object
    context: PromptContext
    leaves: PromptContext


class PrefixSharingMixin:
    """`trl.GRPOTrainer` mixin: log-probs/entropies and non-vLLM generation with each shared prompt token encoded once.

    Put it before `trl.GRPOTrainer` in the bases. It overrides three hooks and leaves every other part of TRL alone, so
    loss types, ``beta > 0`` (reference model or PEFT adapter toggle), ``num_iterations > 1`` (old log-probs),
    LoRA, gradient checkpointing and the fused LM head all go through TRL's code with the same numbers:

    - ``_get_per_token_logps_and_entropies``:
      - training forward/backward (inside ``training_step``): the shared prompt parts of the whole generation batch
        are encoded once per gradient-accumulation cycle (`encode_prompt_context`, with gradients) and every
        micro-batch encodes only its rows' own tokens on top of them (`context_logps_and_entropies`); the micro-
        batches read detached leaf copies of the context, and after the cycle's last backward the gradient those
        leaves accumulated goes through the context's graph once (``training_step``), so every parameter gets
        the gradient of the plain computation. Single process without DeepSpeed/FSDP, no gradient checkpointing,
        ``steps_per_generation == gradient_accumulation_steps`` (`_cycle_unsupported_reason`); elsewhere each
        micro-batch shares what its own rows have in common (`shared_prefix_logps_and_entropies`).
      - no-grad calls over many chunks (old log-probs, reference log-probs over the generation batch): the
        context is encoded once for the whole call, each chunk of ``batch_size`` rows on top of it.
    - ``_generate_single_turn`` (transformers ``generate`` path only): `shared_prefix_generate`.

    ``args.share_prompt_prefix`` (default on) switches all of it off, ``args.share_prompt_prefix_across_microbatches``
    (default on) the once-per-cycle / once-per-call context; where sharing can't be exact (see
    `sharing_unsupported_reason`, multimodal inputs, MoE aux loss, vLLM/continuous batching) TRL's own code runs and
    the reason is logged once.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # attributes (not only the frozen args) so a caller can compare the paths on one trainer
        self.share_prompt_prefix = getattr(self.args, "share_prompt_prefix", True)
        self.share_prompt_prefix_across_microbatches = getattr(
            self.args, "share_prompt_prefix_across_microbatches", True
        )
        self._prefix_cycle: _Cycle | None = None
        self._in_training_step = False
        self._micro_batches_in_step = 0  # training_step calls since the last optimizer step

    def _count_prefix_tokens(self, plan: PrefixPlan | None, rows: int, shared: bool, kind: str = "chunks") -> None:
        """``prefix_sharing_stats``: log-prob chunks / generate calls run shared and plain, and the log-prob
        forwards' prompt tokens encoded vs those of the plain path."""
        stats = self.__dict__.setdefault("prefix_sharing_stats", collections.Counter())
        stats[f"{'shared' if shared else 'plain'}_{kind}"] += 1
        stats["rows"] += rows if kind == "chunks" else 0
        if plan is not None:
            stats["prompt_tokens"] += plan.plain_prompt_tokens
            stats["prompt_tokens_encoded"] += plan.shared_prompt_tokens if shared else plan.plain_prompt_tokens

    def _count_context(self, context: PromptContext, grad: bool) -> None:
        """``prefix_sharing_stats``: contexts encoded (``cycle_contexts`` with gradients once per accumulation cycle,
        ``call_contexts`` without, once per log-prob call) and their tokens, which count as encoded prompt tokens."""
        stats = self.__dict__.setdefault("prefix_sharing_stats", collections.Counter())
        stats["cycle_contexts" if grad else "call_contexts"] += 1
        stats["context_tokens"] += context.tokens
        stats["prompt_tokens_encoded"] += context.tokens

    def _count_context_chunk(self, prompts: list, grad: bool) -> None:
        """A chunk run on a context: its plain prompt tokens against the one token per row it encodes itself."""
        stats = self.__dict__.setdefault("prefix_sharing_stats", collections.Counter())
        stats["shared_chunks"] += 1
        stats["cycle_chunks" if grad else "call_chunks"] += 1
        stats["rows"] += len(prompts)
        stats["prompt_tokens"] += sum(len(p) for p in prompts)
        stats["prompt_tokens_encoded"] += len(prompts)

    def _sharing_enabled(self) -> bool:
        return getattr(self, "share_prompt_prefix", getattr(self.args, "share_prompt_prefix", True))

    def _prefix_sharing_reason(self, model, model_inputs: dict) -> str | None:
        if any(value is not None for value in model_inputs.values()):
            return "multimodal inputs"
        return sharing_unsupported_reason(model)

    def _cycle_unsupported_reason(self, grad: bool) -> str | None:
        """Why the prompt context can't serve many chunks exactly and simply ("" when switched off), or ``None``."""
        if not getattr(self, "share_prompt_prefix_across_microbatches", True):
            return ""
        if self.accelerator.num_processes != 1:
            return "more than one process (each process's backward must see its own gradient sync)"
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return "DeepSpeed/FSDP shard or gather parameters around each forward"
        if grad and self.args.gradient_checkpointing:
            return "gradient checkpointing drops the cache from the forward"
        if grad and self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            return "steps_per_generation != gradient_accumulation_steps (a cycle is not one generation batch)"
        return None

    def training_step(self, model, inputs, num_items_in_batch):
        self._in_training_step = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self._prefix_cycle, self._micro_batches_in_step = None, 0  # a cut-short cycle must not serve the next
            raise
        finally:
            self._in_training_step = False
        # The optimizer steps after the last of the optimizer step's `current_gradient_accumulation_steps` micro-
        # batches (transformers sets it per optimizer step, fewer at an epoch's end; TRL's training_step reads it
        # too). Not `accelerator.sync_gradients`, though transformers sets it before that last training_step:
        # accelerate's gradient state is process-global, so another trainer in the process (bench/step_time.py
        # runs two in threads) flips it. Settling early would be exact too, only slower (a new context).
        self._micro_batches_in_step += 1
        if self._micro_batches_in_step >= max(1, int(self.current_gradient_accumulation_steps)):
            self._micro_batches_in_step = 0
            if self._prefix_cycle is not None:
                self._flush_prefix_cycle()
        return loss

    def _flush_prefix_cycle(self) -> None:
        """Send the gradient the cycle's micro-batches left on the context leaves through the context's graph (one
        backward, then the graph is freed). Exact at any point before the optimizer step: the parameters the context
        was encoded with are still the current ones."""
        cycle, self._prefix_cycle = self._prefix_cycle, None
        tensors, grads = [], []
        for tensor, leaf in zip(
            cycle.context.keys + cycle.context.values, cycle.leaves.keys + cycle.leaves.values, strict=True
        ):
            if leaf.grad is not None and tensor.requires_grad:  # frozen parts (LoRA without k_proj) have no graph
                tensors.append(tensor)
                grads.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _generation_batch_prompts(self, prompts: list) -> list:
        """The prompts of the buffered generation batch (TRL's ``_buffered_inputs``, all its micro-batches) and
        `prompts`."""
        everything = list(prompts)
        for micro_batch in getattr(self, "_buffered_inputs", None) or []:
            ids, mask = micro_batch.get("prompt_ids"), micro_batch.get("prompt_mask")
            if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor):
                everything.extend(prompts_from_left_padded(ids, mask, ids.size(1)) or [])
        return everything

    def _cycle_context(self, model, prompts: list, pad_token_id: int) -> PromptContext | None:
        """The leaf context of the current accumulation cycle (encoded at its first micro-batch), or ``None``."""
        cycle = self._prefix_cycle
        if cycle is not None and (
            cycle.model is not model or any(tuple(p) not in cycle.context.group_of for p in prompts)
        ):
            self._flush_prefix_cycle()  # not this generation batch: settle the old one, encode anew (still exact)
            cycle = None
        if cycle is None:
            with self.accelerator.autocast():
                context = encode_prompt_context(
                    model, self._generation_batch_prompts(prompts), pad_token_id=pad_token_id
                )
            if context is None:
                return None
            self._count_context(context, grad=True)
            leaves = context.with_kv(
                [k.detach().requires_grad_(k.requires_grad) for k in context.keys],
                [v.detach().requires_grad_(v.requires_grad) for v in context.values],
            )
            cycle = self._prefix_cycle = _Cycle(model, context, leaves)
        return cycle.leaves

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        plain = super()._get_per_token_logps_and_entropies  # TRL's
        if not self._sharing_enabled():
            return plain(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                         compute_aux_loss, **model_inputs)  # fmt: skip
        reason = self._prefix_sharing_reason(model, model_inputs)
        if reason is None and compute_aux_loss:
            reason = "the MoE load-balancing loss reads a 2D padding mask"
        if reason is not None:
            log_fallback_once(reason)
            return plain(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                         compute_aux_loss, **model_inputs)  # fmt: skip
        # TRL 1.16 chunks the rows by `batch_size` to bound memory; so do we
        batch_size = batch_size or input_ids.size(0)
        pad_token_id = getattr(getattr(self, "_tokenizer", None), "pad_token_id", None) or 0
        prompt_length = input_ids.size(1) - logits_to_keep
        context = self._call_context(model, input_ids, attention_mask, prompt_length, batch_size, pad_token_id)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            result = None
            if context is not None:  # the prompt parts are encoded already: only the rows' own tokens
                with self.accelerator.autocast():
                    result = context_logps_and_entropies(
                        model, context, ids, mask, logits_to_keep, compute_entropy, pad_token_id=pad_token_id
                    )
                if result is not None:
                    self._count_context_chunk(
                        prompts_from_left_padded(ids, mask, prompt_length), torch.is_grad_enabled()
                    )
            if result is None:
                prompts = prompts_from_left_padded(ids, mask, prompt_length)
                plan = plan_prefix(prompts) if prompts is not None else None
                if plan is None:
                    log_fallback_once("a prompt is empty or not left-padded")
                elif plan.shares:
                    with self.accelerator.autocast():
                        result = shared_prefix_logps_and_entropies(
                            model, ids, mask, logits_to_keep, compute_entropy, pad_token_id=pad_token_id, plan=plan
                        )
                self._count_prefix_tokens(plan, ids.size(0), result is not None)
            if result is None:  # nothing shared in this chunk: TRL's forward, bit for bit
                result = plain(model, ids, mask, logits_to_keep, compute_entropy=compute_entropy)[:2]
            all_logps.append(result[0])
            all_entropies.append(result[1])
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None

    def _call_context(self, model, input_ids, attention_mask, prompt_length, batch_size, pad_token_id):
        """The prompt context the chunks of this call read, or ``None`` (then each chunk shares on its own): the
        accumulation cycle's in a training forward with gradients; one encoded for the call when it runs without
        gradients over more than one chunk (old and reference log-probs of the generation batch)."""
        grad = torch.is_grad_enabled()
        if grad and not (self._in_training_step and model.training):
            return None
        if not grad and input_ids.size(0) <= batch_size:
            return None  # one chunk: the per-chunk packing encodes each shared token once already
        reason = self._cycle_unsupported_reason(grad)
        if reason is not None:
            if reason:
                log_prefix_once(f"prompt parts encoded per micro-batch, not once per generation batch: {reason}")
            return None
        prompts = prompts_from_left_padded(input_ids, attention_mask, prompt_length)
        if prompts is None:
            return None
        if grad:
            return self._cycle_context(model, prompts, pad_token_id)
        with self.accelerator.autocast():
            context = encode_prompt_context(model, prompts, pad_token_id=pad_token_id)
        if context is not None:
            self._count_context(context, grad=False)
        return context

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reason = None
        if not self._sharing_enabled() or self.use_vllm:
            reason = ""  # off, or vLLM, which caches prefixes itself: nothing to log
        elif self.use_transformers_continuous_batching:
            reason = "transformers continuous batching manages its own cache"
        elif images is not None or multimodal_fields or has_tool_images or getattr(self, "_is_vlm", False):
            reason = "multimodal inputs"
        else:
            reason = generation_unsupported_reason(self.model, self.generation_config)
        if reason is not None:
            if reason:
                log_fallback_once(reason)
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self._count_prefix_tokens(None, len(prompt_ids), True, kind="generations")
        return self._shared_prefix_generate_single_turn(prompt_ids)

    def _shared_prefix_generate_single_turn(self, prompt_ids):
        """TRL 1.16 ``_generate_single_turn``'s transformers-generate branch, text only, with the shared-prefix
        prefill (`shared_prefix_generate`) in place of ``unwrapped_model.generate``."""
        from trl.extras.profiling import profiling_context
        from trl.models import unwrap_model_for_generation

        with (
            profiling_context(self, "transformers.generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            prompt_completion_ids = shared_prefix_generate(
                unwrapped_model,
                prompt_ids,
                self._tokenizer.pad_token_id,
                generation_config=self.generation_config,
                pad_to_multiple_of=self.pad_to_multiple_of,
            )
        prompt_length = max(len(p) for p in prompt_ids)
        if self.pad_to_multiple_of:
            prompt_length = -(-prompt_length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        completion_ids = prompt_completion_ids[:, prompt_length:]
        # Mask everything after the first EOS token (as TRL does)
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completion_ids.device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=completion_ids.device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        completion_ids = [
            c[m].tolist() for c, m in zip(completion_ids.cpu(), completion_mask.bool().cpu(), strict=True)
        ]
        return completion_ids, None
