"""`trl_grpo_ext.cpu.decode_attention`: a CPU bf16 decode step's grouped-query attention as one packed sdpa call."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trl_grpo_ext.cpu.decode_attention import packed_decode_attention
from trl_grpo_ext.prefix import attention as prefix_attention

ROWS, HEADS, KV_HEADS, DIM, KEYS = 6, 9, 3, 64, 37


def _inputs(dtype=torch.bfloat16, q_len=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(ROWS, HEADS, q_len, DIM, generator=g).to(dtype)
    key = torch.randn(ROWS, KV_HEADS, KEYS, DIM, generator=g).to(dtype)
    value = torch.randn(ROWS, KV_HEADS, KEYS, DIM, generator=g).to(dtype)
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False)
    return module, query, key, value


def _reference(query, key, value, mask):
    """Plain attention in float64, each query head on its own key/value head."""
    groups = HEADS // KV_HEADS
    k, v = (t.double().repeat_interleave(groups, 1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask, scale=DIM**-0.5)
    return out.transpose(1, 2)


def _padding_mask(dtype=torch.bool):
    visible = torch.ones(ROWS, 1, 1, KEYS, dtype=torch.bool)
    visible[::2, ..., :5] = False  # left padding of every other row
    if dtype == torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("inputs", ["bf16", "fp32 under bf16 autocast"])
def test_packed_decode_step_is_the_attention(mask_kind, inputs):
    autocast = inputs != "bf16"
    module, query, key, value = _inputs(torch.float32 if autocast else torch.bfloat16)
    if autocast:  # as in a Llama layer under autocast: q and k fp32 after the rotary embedding, v from its projection
        value = value.to(torch.bfloat16)
    mask = None if mask_kind == "none" else _padding_mask(torch.bool if mask_kind == "bool" else torch.bfloat16)
    args = (module, query, key, value, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, weights = packed_decode_attention(*args, dropout=0.0, scaling=DIM**-0.5)
        theirs, _ = sdpa_attention_forward(*args, dropout=0.0, scaling=DIM**-0.5)
    assert weights is None and out.shape == (ROWS, 1, HEADS, DIM)
    assert out.dtype == torch.bfloat16
    ref_mask = None if mask is None else _padding_mask()
    torch.testing.assert_close(out.double(), _reference(query, key, value, ref_mask), atol=0.02, rtol=0)
    if mask is not None and hasattr(sdpa_attention, "pack_gqa"):  # transformers' own packed call: the same bits
        assert torch.equal(out, theirs)
    else:  # its enable_gqa kernel, or (before 5.20) repeated key/value heads: to bf16 rounding
        torch.testing.assert_close(out, theirs, atol=0.02, rtol=0)


def test_other_calls_are_left_to_transformers():
    module, query, key, value = _inputs()
    args = dict(dropout=0.0, scaling=DIM**-0.5)
    assert (
        packed_decode_attention(module, *_inputs(torch.float32)[1:], None, **args) is None
    )  # fp32: its kernel is fast
    assert packed_decode_attention(module, *_inputs(q_len=4)[1:], None, **args) is None  # prefill
    assert packed_decode_attention(SimpleNamespace(num_key_value_groups=1), query, key, value, None, **args) is None
    assert packed_decode_attention(module, query, key, value, None, dropout=0.1, scaling=DIM**-0.5) is None
    assert packed_decode_attention(module, query, key, value, None, softcap=30.0, **args) is None
    assert packed_decode_attention(module, query, key, value, None, s_aux=torch.zeros(HEADS), **args) is None
    per_head = torch.ones(ROWS, HEADS, 1, KEYS, dtype=torch.bool)
    assert packed_decode_attention(module, query, key, value, per_head, **args) is None


def test_installed_wrapper_runs_decode_steps_packed(tiny_model_path, monkeypatch):
    """A bf16 greedy decode of a grouped-query model (4 query heads, 2 key/value heads) through the installed sdpa
    wrapper: its decode steps take the packed call and give transformers' logits, to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    calls = []

    def counting(*args, **kwargs):
        out = packed_decode_attention(*args, **kwargs)
        calls.append(out is not None)
        return out

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True)
    kwargs["return_dict_in_generate"] = True
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        prefix_attention.install()
        monkeypatch.setattr(prefix_attention, "packed_decode_attention", counting)
        ours = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    layers = model.config.num_hidden_layers
    assert calls.count(True) == 5 * layers  # every decode step after the prompt's, in every layer
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), atol=0.05, rtol=0)
