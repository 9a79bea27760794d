"""``model.generate`` with each shared prompt token encoded once (`shared_prefix_generate`) and when it applies."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from trl_grpo_ext.compat import cache_kwargs
from trl_grpo_ext.prefix.plan import plan_prefix
from trl_grpo_ext.prefix.support import _config_of, log_fallback_once, sharing_unsupported_reason


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
    engine: str = "generate",
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

    `engine`: the decode loop after the prompts are encoded (`trl_grpo_ext.decode`): ``generate`` (transformers')
    or ``packed`` (a static cache and prepacked weights, where it applies).
    """
    from transformers import DynamicCache

    from trl_grpo_ext.decode import check_engine, decode

    check_engine(engine)

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
        return decode(model, engine, padded, padded_mask, **kwargs)

    cache = DynamicCache(config=_config_of(model))
    length = plan.prefix_length
    if length:
        prefix = torch.tensor([list(plan.prompts[0][:length])], device=device)
        positions = torch.arange(length, device=device)[None]
        model(input_ids=prefix, position_ids=positions, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
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
        model(input_ids=rest_ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache), use_cache=True,
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
    out = decode(model, engine, ids, mask, cache=cache, **kwargs)
    if isinstance(out, torch.Tensor):
        return torch.cat([padded, out[:, ids.size(1) :]], dim=1)
    out.sequences = torch.cat([padded, out.sequences[:, ids.size(1) :]], dim=1)  # return_dict_in_generate
    return out
