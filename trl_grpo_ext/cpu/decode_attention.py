"""A decode step's attention on the CPU with grouped key/value heads, where it runs in bf16: one packed call.

At a decode step each row has one query token per head. With grouped-query attention (``num_key_value_groups`` query
heads per key/value head, 3 in SmolLM2-135M) transformers' ``sdpa`` either passes ``enable_gqa=True`` (no mask:
prompts of equal length) or copies the keys and values once per group (``repeat_kv``: transformers before 5.20 with
a mask); transformers 5.25 packs each key/value head's group of queries into one ``(group, dim)`` query block
(``pack_gqa``) for masked calls only. In bf16 on the CPU (the sampler's autocast, `trl_grpo_ext.cpu.precision`, or bf16
weights) the unpacked calls are slow: torch 2.13's bf16 flash kernel took 1.55 ms a layer at 24 rows of 170 keys
with ``enable_gqa`` against 0.32 ms packed (`bench/sampler.py`, 2 cores). `packed_decode_attention` makes every
such step the packed call, mask or not, whatever the transformers version: for a masked call under transformers
5.25 the very call transformers makes (the same result to the bit), otherwise the same attention (each query sees
its own key/value head's keys) to the rounding of a different summation order.

It is applied through the package's wrapper of transformers' registered ``sdpa`` (`trl_grpo_ext.prefix.attention`,
`install`), on calls that carry no prefix-sharing layout.
"""

from __future__ import annotations

import torch

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _autocast_lowers(query) -> bool:
    """fp32 `query` that CPU autocast would cast to a half dtype for ``sdpa``."""
    return (
        query.dtype == torch.float32
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") in PACKED_DTYPES
    )


def _applies(module, query, key, attention_mask, dropout, kwargs) -> bool:
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[2] != 1:
        return False
    if query.dtype not in PACKED_DTYPES and not _autocast_lowers(query):
        return False
    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1 or key.shape[1] * groups != query.shape[1]:
        return False
    # what the packed call can't carry: dropout, a soft cap, attention sinks, a position bias, per-head masks
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return False
    if kwargs.get("position_bias") is not None:
        return False
    if attention_mask is None:
        return True
    return attention_mask.dim() == 4 and attention_mask.shape[1:] == (1, 1, key.shape[2])


def packed_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' ``sdpa_attention_forward`` for a decode step on the CPU with grouped key/value heads where it runs
    in bf16/fp16, as one ``sdpa`` call over each key/value head's group of queries (module docstring); None where it
    does not apply (then transformers' own function runs)."""
    if not _applies(module, query, key, attention_mask, dropout, kwargs):
        return None
    rows, heads, _, dim = query.shape
    # query head h reads key/value head h // groups (repeat_kv's order): heads are grouped consecutively
    packed = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    # under autocast, cast to bf16 by the call as transformers' own (fp32 q and k after the rotary embedding)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None
