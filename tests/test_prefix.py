"""Shared-prefix computation (`trl_grpo_ext.prefix`) against the plain computation, on the tiny model in fp32.

Log-probs and entropies to 1e-4 absolute, parameter gradients to 1e-5 relative (per tensor), greedy tokens identical,
sampled per-step logits to 1e-4 with the same seed; a batch with nothing shared gives TRL's result bit for bit.
"""

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, GenerationConfig, TrainerCallback
from trl.trainer.utils import add_fused_lm_head, shuffle_sequence_dict, split_tensor_dict

from trl_grpo_ext.prefix import (
    PrefixPlan,
    context_logps_and_entropies,
    encode_prompt_context,
    pack_rows,
    packed_unsupported_reason,
    plan_prefix,
    plan_token_rows,
    prompts_from_left_padded,
    shared_prefix_generate,
    shared_prefix_logps_and_entropies,
    sharing_unsupported_reason,
)
from trl_grpo_ext.prefix import attention as prefix_attention
from trl_grpo_ext.prefix import cost as prefix_cost
from trl_grpo_ext.prefix.attention import plan_buckets
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.trainer import GRPOTrainer

LOGP_ATOL = 1e-4
GRAD_RTOL = 1e-5


# ---------------------------------------------------------------------------------------------------------- helpers
def load(path, attn="sdpa", fused=True, temperature=1.0):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    if fused:
        add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def rand_tokens(n, vocab, generator):
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def trl_layout(prompts, completions, lengths):
    """TRL's tensors: prompts left-padded, completions right-padded with the mask 0 after `lengths[i]` tokens."""
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p_len + c_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c, n) in enumerate(zip(prompts, completions, lengths, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        mask[i, p_len - len(p) : p_len] = 1
        ids[i, p_len : p_len + len(c)] = torch.tensor(c)
        mask[i, p_len : p_len + n] = 1
    return ids, mask, c_len


def plain_fused(model, ids, mask, keep):
    """TRL 1.16's `_get_per_token_logps_and_entropies` for one chunk."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -keep:], out.entropy[:, -keep:]


def grads_of(model, value):
    model.zero_grad()
    value.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got, want):
    """Relative difference of all parameter gradients together <= 1e-5, and of each tensor <= 5e-5: on the
    embedded model TRL's own forward with one more padding column moves single tensors by up to 1.7e-5 (fp32
    rounding of RoPE at other absolute positions), all of them together by 4e-6."""
    assert got.keys() == want.keys() and want
    diff = sum((got[n] - want[n]).double().norm() ** 2 for n in want) ** 0.5
    total = sum(want[n].double().norm() ** 2 for n in want) ** 0.5
    assert diff / total <= GRAD_RTOL, (diff / total).item()
    for name in want:
        rel = ((got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)).item()
        assert rel <= 5 * GRAD_RTOL, (name, rel)


def batch(vocab, seed=0, common=24, rests=(5, 9, 2), rows=(0, 1, 0, 2, 1, 0), completion=7):
    g = torch.Generator().manual_seed(seed)
    shared = rand_tokens(common, vocab, g)
    distinct = [shared + rand_tokens(n, vocab, g) for n in rests]
    prompts = [distinct[r] for r in rows]
    completions = [rand_tokens(completion, vocab, g) for _ in rows]
    lengths = [completion - (i % 3) * 2 for i in range(len(rows))]  # EOS at different places: masked tails
    return prompts, completions, lengths


# ---------------------------------------------------------------------------------------------------------- plan
def test_plan_levels_groups_need_not_be_adjacent():
    plan = plan_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [1, 2, 5, 6, 7]])
    assert plan.prefix_length == 2  # capped at min length - 1 = 2 anyway
    assert plan.groups == ((0, 2), (1,), (3,)) and plan.row_group == (0, 1, 0, 2)
    assert plan.remainder(0) == (3,) and plan.remainder(1) == () and plan.remainder(2) == (5, 6)
    assert plan.plain_prompt_tokens == 16 and plan.shared_prompt_tokens == 2 + 3 + 4 and plan.shares
    # the prefix never swallows a row's last prompt token (it scores the first completion token)
    assert plan_prefix([[7, 8, 9]] * 3).prefix_length == 2
    assert not plan_prefix([[1, 2], [3, 4]]).shares
    with pytest.raises(ValueError):
        plan_prefix([[1], []])


def test_prompts_from_left_padded_rejects_other_layouts():
    ids = torch.tensor([[0, 5, 6, 9], [4, 5, 6, 9]])
    assert prompts_from_left_padded(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), 3) == [[5, 6], [4, 5, 6]]
    assert prompts_from_left_padded(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), 3) is None  # hole
    assert prompts_from_left_padded(ids, torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]]), 3) is None  # empty prompt


def test_pack_rows_layout_and_visibility():
    plan = plan_prefix([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3]])
    packed = pack_rows(plan, [[7, 8], [9], [6]], [[True, False], [True], [True]])
    # [prefix 1 2][row 0: 3 7 8][row 2: 3 6][group 1 rest: 4][row 1: 5 9]
    assert packed.input_ids[0].tolist() == [1, 2, 3, 7, 8, 3, 6, 4, 5, 9]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 2, 3, 4]
    assert packed.labels[0].tolist() == [-100, -100, -100, 7, -100, -100, 6, -100, -100, 9]
    see = packed.visible[0, 0]
    assert see[9].tolist() == [True, True, False, False, False, False, False, True, True, True]
    assert see[6].tolist() == [True, True, False, False, False, True, True, False, False, False]
    assert not see[:, 4].any()  # a padded completion slot is nobody's key
    assert packed.row_slots == [(0, 2, 2), (0, 8, 1), (0, 5, 1)]


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    assert "model_type 'gpt2'" in sharing_unsupported_reason(gpt2)
    small = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**small))
    assert sharing_unsupported_reason(llama) is None
    for attn in ("flash_attention_2", "flex_attention"):  # packed: segment attention; a shared cache: not tested
        llama.config._attn_implementation = attn
        assert "sdpa or eager only" in sharing_unsupported_reason(llama)
    assert "CUDA only" in packed_unsupported_reason(llama)  # flex on CPU
    llama.config._attn_implementation = "flash_attention_2"
    assert packed_unsupported_reason(llama) is None
    llama.config._attn_implementation = "paged|sdpa"
    assert "attention implementation 'paged|sdpa' is not one of" in packed_unsupported_reason(llama)
    dynamic = LlamaForCausalLM(LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert "RoPE type 'dynamic'" in sharing_unsupported_reason(dynamic)
    from peft import LoraConfig, PrefixTuningConfig, get_peft_model

    lora = get_peft_model(LlamaForCausalLM(LlamaConfig(**small)), LoraConfig(r=2, target_modules=["q_proj"]))
    assert sharing_unsupported_reason(lora) is None
    prefix_tuning = get_peft_model(
        LlamaForCausalLM(LlamaConfig(**small)), PrefixTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM")
    )
    assert "prompt-learning" in sharing_unsupported_reason(prefix_tuning)


# ---------------------------------------------------------------------------------------------------------- forward
def with_hole(mask, keep):
    """A completion slot masked before its row's end (TRL's mask allows it: nobody's key, not scored)."""
    mask = mask.clone()
    mask[1, -keep + 2] = 0
    return mask


def reference(model, hole=False):
    """`batch`'s rows in TRL's layout, loss weights, and TRL's log-probs, entropies and parameter gradients."""
    prompts, completions, lengths = batch(model.config.vocab_size)
    ids, mask, keep = trl_layout(prompts, completions, lengths)
    if hole:
        mask = with_hole(mask, keep)
    weights = torch.randn(ids.size(0), keep, generator=torch.Generator().manual_seed(3))
    logps, entropies = plain_fused(model, ids, mask, keep)
    want = grads_of(model, (logps * weights).sum() + entropies.sum())
    return prompts, ids, mask, keep, weights, logps, entropies, want


@pytest.mark.parametrize(
    ("attn", "budget", "temperature", "overhead", "hole"),
    [
        ("sdpa", None, 1.0, None, False),  # the cost model's bucketing
        ("sdpa", None, 0.7, 0.0, False),  # no call overhead: many causal buckets
        ("sdpa", None, 1.0, 1e30, False),  # prohibitive overhead: one masked bucket
        ("sdpa", None, 1.0, None, True),  # a hole inside a completion: masked buckets
        ("sdpa", 40, 1.0, None, False),  # bins (each with its own prefix copy), concatenated
        ("eager", 4096, 0.7, None, False),  # the dense mask
        ("eager", 40, 1.0, None, True),  # dense mask over several bins
    ],
)
def test_shared_forward_equals_plain(tiny_model_path, monkeypatch, attn, budget, temperature, overhead, hole):
    if overhead is not None:
        monkeypatch.setitem(prefix_cost.CALL_OVERHEAD_FLOPS, "cpu", overhead)
    model = load(tiny_model_path, attn, temperature=temperature)
    _, ids, mask, keep, weights, logps, entropies, want = reference(model, hole)
    result = shared_prefix_logps_and_entropies(
        model, ids, mask, keep, compute_entropy=True, max_packed_tokens=budget, layout="packed"
    )
    assert result is not None
    got_logps, got_entropies = result
    got = grads_of(model, (got_logps * weights).sum() + got_entropies.sum())

    torch.testing.assert_close(got_logps, logps, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(got_entropies, entropies, atol=LOGP_ATOL, rtol=0)
    completion_mask = mask[:, -keep:].bool()
    assert torch.all(got_logps[~completion_mask] == 0) and torch.all(got_entropies[~completion_mask] == 0)
    assert_grads_close(got, want)


def test_bucket_plans_cover_every_segment_once():
    anc, own = [0, 24, 24, 30, 30, 30, 26], [24, 5, 9, 8, 3, 8, 6]
    for overhead in (0, 1000, 10**9):
        for holes in (False, True):
            buckets = plan_buckets(anc, own, holes, overhead)
            assert sorted(s for b in buckets for s in b.segments) == list(range(len(own)))
            assert not holes or not any(b.causal for b in buckets)
            for b in buckets:
                assert b.width == max(own[s] for s in b.segments) and b.front == max(anc[s] for s in b.segments)
                assert not b.causal or len({anc[s] for s in b.segments}) == 1
    assert len(plan_buckets(anc, own, False, 10**9)) == 1  # one call when calls are dear
    free = plan_buckets(anc, own, False, 0)  # calls cost nothing: fewest pairs, more calls
    assert sum(b.pairs for b in free) < sum(b.pairs for b in plan_buckets(anc, own, False, 10**9))
    assert len(free) > 1 and any(b.causal for b in free)


def test_cost_model_picks_the_cheaper_layout(tiny_model_path):
    model = load(tiny_model_path)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    # a 400-token prompt shared by 4 rows with short completions: packing encodes it once
    shared = [rand_tokens(400, vocab, g)] * 4
    ids, mask, keep = trl_layout(shared, [rand_tokens(16, vocab, g) for _ in range(4)], [16, 9, 16, 4])
    stats = {}
    assert shared_prefix_logps_and_entropies(model, ids, mask, keep, stats=stats) is not None
    assert stats["layout"] == "packed" and stats["packed_cost"] < stats["padded_cost"]
    assert stats["tokens"] < stats["padded_tokens"] / 3
    # two rows sharing one token of 3-token prompts with 60-token completions and no padding: nothing to gain
    prompts = [[7] + rand_tokens(2, vocab, g), [7] + rand_tokens(2, vocab, g)]
    ids, mask, keep = trl_layout(prompts, [rand_tokens(60, vocab, g) for _ in prompts], [60, 60])
    stats = {}
    assert shared_prefix_logps_and_entropies(model, ids, mask, keep, stats=stats) is None
    assert stats["layout"] == "padded" and stats["packed_cost"] > prefix_cost.MARGIN * stats["padded_cost"]
    assert shared_prefix_logps_and_entropies(model, ids, mask, keep, layout="packed") is not None


def fake_varlen_flash(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):  # fmt: skip
    """transformers' flash-attention varlen contract (one stream, cumulative sequence lengths, causal mask
    aligned bottom-right per sequence as flash-attn >= 2.1 does) computed with sdpa per sequence: flash-attn
    can't be installed here, this checks the layout we hand to it."""
    assert attention_mask is None and is_causal and query.size(0) == 1
    outputs = []
    groups = query.size(1) // key.size(1)
    for i in range(cu_seq_lens_q.numel() - 1):
        q = query[:, :, cu_seq_lens_q[i] : cu_seq_lens_q[i + 1]]
        k = key[:, :, cu_seq_lens_k[i] : cu_seq_lens_k[i + 1]].repeat_interleave(groups, 1)
        v = value[:, :, cu_seq_lens_k[i] : cu_seq_lens_k[i + 1]].repeat_interleave(groups, 1)
        visible = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril(k.size(2) - q.size(2))
        outputs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, visible, scale=scaling))
    assert max(o.size(2) for o in outputs) == max_length_q
    return torch.cat(outputs, dim=2).transpose(1, 2), None


def test_flash_attention_layout_equals_plain(tiny_model_path, monkeypatch):
    """The varlen flash-attention path (`SegmentAttention` kind "flash") with a reference of transformers'
    varlen flash call: per-chunk packing and the context path, log-probs and gradients (flash-attn itself
    needs CUDA: not run here)."""
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", fake_varlen_flash)
    monkeypatch.setattr(prefix_attention, "_WRAPPED", {})
    model = load(tiny_model_path, "sdpa", temperature=0.7)
    prompts, ids, mask, keep, weights, logps, entropies, want = reference(model)
    model.config._attn_implementation = "flash_attention_2"
    assert packed_unsupported_reason(model) is None
    got_logps, got_entropies = shared_prefix_logps_and_entropies(model, ids, mask, keep, True, layout="packed")
    torch.testing.assert_close(got_logps, logps, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(got_entropies, entropies, atol=LOGP_ATOL, rtol=0)
    assert_grads_close(grads_of(model, (got_logps * weights).sum() + got_entropies.sum()), want)
    check_context_forward(model, ids, mask, keep, prompts, weights, logps, entropies, want, None)
    # flash-attention can't leave a key out inside a sequence: a completion with a hole goes to TRL's forward
    assert shared_prefix_logps_and_entropies(model, ids, with_hole(mask, keep), keep, layout="packed") is None


def test_flex_attention_layout_equals_plain(tiny_model_path, monkeypatch):
    """The flex-attention path (`SegmentAttention` kind "flex": one BlockMask) against TRL's forward, without
    gradients: FlexAttention has no backward on CPU. torch 2.13's CPU flex kernel also fails to compile a mask
    that indexes by query once inductor makes the shapes dynamic (the trainer then falls back, see
    `packed_unsupported_reason`); the test compiles each shape statically."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("FlexAttention on CPU compiles C++ (torch inductor): no C++ compiler on this machine")
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    model = load(tiny_model_path, "flex_attention", temperature=0.7)
    assert "CUDA only" in packed_unsupported_reason(model)
    prompts, completions, lengths = batch(model.config.vocab_size)
    ids, mask, keep = trl_layout(prompts, completions, lengths)
    with torch.no_grad():
        logps, entropies = plain_fused(load(tiny_model_path, "sdpa", temperature=0.7), ids, mask, keep)
        got_logps, got_entropies = shared_prefix_logps_and_entropies(model, ids, mask, keep, True, layout="packed")
        torch.testing.assert_close(got_logps, logps, atol=LOGP_ATOL, rtol=0)
        torch.testing.assert_close(got_entropies, entropies, atol=LOGP_ATOL, rtol=0)
        context = encode_prompt_context(model, prompts)
        got = [context_logps_and_entropies(model, context, ids[r], mask[r], keep, True) for r in CHUNKS]
        torch.testing.assert_close(torch.cat([lp for lp, _ in got]), logps, atol=LOGP_ATOL, rtol=0)


def test_nothing_shared_is_left_to_the_plain_forward(tiny_model_path):
    model = load(tiny_model_path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    ids, mask, keep = trl_layout(prompts, [[3, 4]] * 3, [2, 2, 1])
    assert shared_prefix_logps_and_entropies(model, ids, mask, keep) is None


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory):
    """The tiny model with three 64-wide key heads: gathered keys then hold enough numbers (32,768 or more) for
    torch to split an advanced-indexing backward over threads, and an odd head count splits a head between two."""
    from conftest import build_tiny_model

    path = tmp_path_factory.mktemp("wide-model")
    return build_tiny_model(path, hidden_size=192, num_attention_heads=3, num_key_value_heads=3)


def test_shared_gradients_do_not_depend_on_the_thread_count(wide_model_path):
    """A shared key's gradient sums what every segment that reads it sends back: the engine adds them in index
    order (`attention.take`) whatever torch's thread count, packed and from a stored context, so under sdpa the
    log-probs, entropies and gradients are the same bits at 1 and 2 threads. (Not under eager: torch's softmax
    backward itself rounds differently at another thread count.)"""
    model = load(wide_model_path, "sdpa")
    prompts, completions, lengths = batch(model.config.vocab_size, common=180, rows=(0, 1, 0, 2, 1, 0) * 2)
    ids, mask, keep = trl_layout(prompts, completions, lengths)
    weights = torch.randn(ids.size(0), keep, generator=torch.Generator().manual_seed(3))

    def packed():
        return shared_prefix_logps_and_entropies(model, ids, mask, keep, True, layout="packed")

    def from_context():
        context = encode_prompt_context(model, prompts_from_left_padded(ids, mask, ids.size(1) - keep))
        return context_logps_and_entropies(model, context, ids, mask, keep, True)

    before = torch.get_num_threads()
    try:
        for forward in (packed, from_context):
            runs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                logps, entropies = forward()
                runs.append((logps, entropies, grads_of(model, (logps * weights).sum() + entropies.sum())))
            (logps_1, entropies_1, grads_1), (logps_2, entropies_2, grads_2) = runs
            assert torch.equal(logps_1, logps_2) and torch.equal(entropies_1, entropies_2), forward.__name__
            assert grads_1.keys() == grads_2.keys() and grads_1
            differ = [name for name in grads_1 if not torch.equal(grads_1[name], grads_2[name])]
            assert not differ, (forward.__name__, differ)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_reads_give_every_position_of_every_row(tiny_model_path, attn):
    """The local PyTRIO server's use of the engine: rows known only as token sequences, grouped by `plan_token_rows`,
    packed by `pack_rows`; `row_reads` finds each row's logits at every position, shared ones included."""
    model = load(tiny_model_path, attn, fused=False)
    prompts, completions, _ = batch(model.config.vocab_size, seed=4, rows=(1, 1, 0, 0, 2))
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    sequences.insert(2, [9, 8, 7, 6])  # shares nothing: groups need not be adjacent
    rows = plan_token_rows(sequences, min_shared=2)
    assert rows.shared == (0, 1, 3, 4) and rows.plain == (2, 5)  # the last row has only the head in common
    assert rows.plan.groups == ((0, 1), (2, 3)) and rows.plan.prefix_length == 24  # level 1: the common head
    packed = pack_rows(rows.plan, rows.completions(sequences), max_packed_tokens=60, attn_implementation=attn)
    # two bins, each with its own copy of the prefix (eager: two stream rows; sdpa: one concatenated stream)
    assert packed.placement.rows == (2 if attn == "eager" else 1) and packed.placement.specs[-3].length == 24
    lengths = [len(sequences[r]) for r in rows.shared]
    slot, reader, readers = packed.row_reads(lengths)
    assert readers == 3  # the most rows reading one slot: the first prefix copy's
    with torch.no_grad():
        logits = model(**packed.forward_kwargs(model)).logits.flatten(0, 1)
        for i, (r, n) in enumerate(zip(rows.shared, lengths, strict=True)):
            full = model(input_ids=torch.tensor([sequences[r]])).logits[0]
            torch.testing.assert_close(logits[slot[i, :n]], full, atol=LOGP_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("rows", [(0, 1, 0, 2, 1, 0), (0, 0, 0, 0)])  # three prompts; one prompt sampled 4 times
def test_generation_equals_generate(tiny_model_path, rows):
    model = load(tiny_model_path, fused=False)
    prompts, _, _ = batch(model.config.vocab_size, seed=2, rows=rows)
    padded = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    attention = torch.zeros_like(padded)
    for i, p in enumerate(prompts):
        padded[i, padded.size(1) - len(p) :], attention[i, padded.size(1) - len(p) :] = torch.tensor(p), 1
    common = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=2, return_dict_in_generate=True, output_logits=True)
    for config in (
        GenerationConfig(do_sample=False, **common),
        GenerationConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, **common),
    ):
        torch.manual_seed(11)
        want = model.generate(input_ids=padded, attention_mask=attention, generation_config=config)
        torch.manual_seed(11)
        got = shared_prefix_generate(model, prompts, 0, config)
        assert torch.equal(got.sequences, want.sequences), config.do_sample
        for step_got, step_want in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(step_got, step_want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------- trainer
PROMPTS = [
    [{"role": "system", "content": "Solve the problem step by step. Put your final answer within \\boxed{}."}]
    + [{"role": "user", "content": text}]
    for text in ("What is 3 + 4?", "Natalia sold 48 clips in April and half as many in May.", "What is 18 + 1,080?")
]
COMMON = dict(
    report_to="none",
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=4,
    max_completion_length=8,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
    epsilon_high=None,
)


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def make_trainer(path, tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig, peft_config=None, **kwargs):
    args = config_cls(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    trainer = cls(
        path,
        [length_reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def generation_batch(trainer, group):
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(group)])


def micro_batch(inputs, seed=0, steps=3):
    """One of TRL's shuffled micro-batches: groups end up split across micro-batches."""
    torch.manual_seed(seed)
    return split_tensor_dict(shuffle_sequence_dict(inputs), steps)[0]


def set_loss(trainer, loss_type):
    ours = loss_type in ("importance_sampling", "cispo", "ppo")
    trainer.ext_loss_type = loss_type if ours else None
    trainer.loss_type = "dapo" if ours else loss_type


def loss_and_grads(trainer, inputs, share):
    trainer.share_prompt_prefix = share
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def check_generation_batch(trainer, group):
    """`_generate_and_score_completions` (sampling, old and reference log-probs) with and without sharing."""
    trainer.share_prompt_prefix = False
    want = generation_batch(trainer, group)
    trainer.share_prompt_prefix = True
    generations = trainer.__dict__.get("prefix_sharing_stats", {}).get("shared_generations", 0)
    got = generation_batch(trainer, group)
    assert trainer.prefix_sharing_stats["shared_generations"] == generations + 1
    if want.get("old_per_token_logps") is not None or want.get("ref_per_token_logps") is not None:
        stats = trainer.prefix_sharing_stats
        assert stats["shared_chunks"] >= 1 and stats["prompt_tokens_encoded"] < stats["prompt_tokens"]
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(got[key], want[key]), key
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert (got.get(key) is None) == (want.get(key) is None), key
        if want.get(key) is not None:
            torch.testing.assert_close(got[key], want[key], atol=LOGP_ATOL, rtol=0)
    return want


def check_losses(trainer, inputs, cases):
    """Loss and gradients with and without sharing for each (loss_type, beta, num_iterations) in `cases`."""
    g = torch.Generator().manual_seed(1)
    inputs = dict(inputs)
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=g)
    on_policy = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    off_policy = None
    if inputs.get("old_per_token_logps") is not None:  # num_iterations > 1: the second iteration is off-policy
        noise = torch.randn(inputs["old_per_token_logps"].shape, generator=g) * 0.3
        off_policy = {**inputs, "old_per_token_logps": inputs["old_per_token_logps"] + noise}
    for loss_type, beta, iterations in cases:
        trainer.beta = beta
        set_loss(trainer, loss_type)
        case = on_policy if iterations == 1 else off_policy
        loss_plain, grads_plain = loss_and_grads(trainer, case, share=False)
        before = trainer.prefix_sharing_stats["shared_chunks"]
        loss_shared, grads_shared = loss_and_grads(trainer, case, share=True)
        assert trainer.prefix_sharing_stats["shared_chunks"] == before + 1  # the shared path ran
        msg = f"{loss_type} beta={beta} num_iterations={iterations}"
        torch.testing.assert_close(loss_shared, loss_plain, atol=1e-6, rtol=1e-5, msg=msg)
        assert_grads_close(grads_shared, grads_plain)


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_trainer_full_fine_tune(tiny_model_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path, beta=0.04, num_generations=4, num_iterations=2)
    assert isinstance(trainer, trl.GRPOTrainer) and trainer.share_prompt_prefix
    inputs = check_generation_batch(trainer, group=4)
    losses = ("dapo", "grpo", "bnpo", "dr_grpo", "sapo", "vespo", "importance_sampling", "cispo", "ppo")
    # every loss type at (beta 0.04, second iteration) and (beta 0, first iteration); dapo at all four
    cases = [(t, 0.04, 2) for t in losses] + [(t, 0.0, 1) for t in losses] + [("dapo", 0.0, 2), ("dapo", 0.04, 1)]
    check_losses(trainer, micro_batch(inputs), cases)


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_trainer_lora_gradient_checkpointing(tiny_model_path, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        peft_config=lora,
        beta=0.04,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_checkpointing=True,
    )
    inputs = check_generation_batch(trainer, group=2)
    check_losses(trainer, micro_batch(inputs, seed=1), [("dapo", 0.04, 1), ("cispo", 0.04, 1)])


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_trainer_one_row_per_prompt(tiny_model_path, tmp_path):
    # What num_generations=1 would give (TRL 1.16 requires >= 2): distinct prompts, so only the chat template and
    # system prompt are shared (level 1) and every level-2 group has one row
    trainer = make_trainer(tiny_model_path, tmp_path, num_generations=2, per_device_train_batch_size=2)
    inputs = check_generation_batch(trainer, group=2)
    one_each = {
        k: v[0::2] if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == 6 else v for k, v in inputs.items()
    }
    assert len(set(map(tuple, one_each["prompt_ids"].tolist()))) == 3
    check_losses(trainer, one_each, [("dapo", 0.0, 1), ("importance_sampling", 0.0, 1)])


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_trainer_batch_sharing_nothing_is_trl_exactly(tiny_model_path, tmp_path):
    vanilla = make_trainer(tiny_model_path, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, num_generations=2)
    ours = make_trainer(tiny_model_path, tmp_path, num_generations=2)
    vocab = ours.model.config.vocab_size
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]  # no common first token, all distinct
    g = torch.Generator().manual_seed(0)
    ids, mask, keep = trl_layout(prompts, [rand_tokens(5, vocab, g) for _ in prompts], [5, 3, 5, 4])
    inputs = {
        "prompt_ids": ids[:, :-keep],
        "prompt_mask": mask[:, :-keep],
        "completion_ids": ids[:, -keep:],
        "completion_mask": mask[:, -keep:],
        "advantages": torch.randn(len(prompts), generator=g),
        "num_items_in_batch": mask[:, -keep:].sum(),
    }
    loss_trl = vanilla._compute_loss(vanilla.model, dict(inputs))
    loss_trl.backward()
    loss_ours = ours._compute_loss(ours.model, dict(inputs))
    loss_ours.backward()
    assert torch.equal(loss_ours, loss_trl)
    for (name, p), (_, q) in zip(vanilla.model.named_parameters(), ours.model.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_config_validates_the_option(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").share_prompt_prefix is True
    with pytest.raises(ValueError, match="share_prompt_prefix"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", share_prompt_prefix="yes")
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").share_prompt_prefix_across_microbatches
    with pytest.raises(ValueError, match="share_prompt_prefix_across_microbatches"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", share_prompt_prefix_across_microbatches=1)
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").max_packed_tokens is None
    assert GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_packed_tokens=512
    ).max_packed_tokens
    for bad in (0, -3, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="max_packed_tokens"):
            GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_packed_tokens=bad)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nmax_packed_tokens: 2048\n")
    (config,) = trl.TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
    assert config.max_packed_tokens == 2048


def test_plan_type_is_exposed():
    assert PrefixPlan.__dataclass_fields__.keys() == {"prompts", "prefix_length", "groups", "row_group"}


def test_eval_generator_decodes_what_generate_decodes(tiny_model_path):
    from trl_grpo_ext.evaluation import HFGenerator
    from trl_grpo_ext.task.data.prompts import build_prompt

    gen = HFGenerator(tiny_model_path, max_new_tokens=6, temperature=1.0, seed=0)
    prompts = [build_prompt(q, one_shot=True, chat=True) for q in ("What is 2 + 3?", "Natalia sold 48 clips.")]
    texts = [gen._text(p) for p in prompts]
    enc = gen.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = enc["input_ids"].size(1)
    for k, greedy in ((1, True), (3, False)):
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        torch.manual_seed(gen.seed + gen._calls)
        out = gen.model.generate(
            **enc, max_new_tokens=6, num_return_sequences=k, pad_token_id=gen.tokenizer.pad_token_id, **sampling
        )
        want = gen.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        got = gen.generate(prompts, k, greedy)
        assert [s for row in got for s in row] == want, greedy


def test_fallback_reason_is_logged_once(caplog):
    from trl_grpo_ext.prefix import log_fallback_once

    with caplog.at_level("WARNING", logger="trl_grpo_ext.prefix"):
        for _ in range(3):
            log_fallback_once("test reason 42")
    assert [r.getMessage() for r in caplog.records].count(
        "prompt-prefix sharing not applied, plain forward used: test reason 42"
    ) == 1


def bf16_deviations(path, attn, seed):
    """Max and mean |log-prob difference| and the relative gradient difference, in bf16, of TRL's forward with one
    more left-padding column and of ours (packed), each against TRL's forward."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompts, completions, lengths = batch(model.config.vocab_size, seed=seed)
    ids, mask, keep = trl_layout(prompts, completions, lengths)
    weights = torch.randn(ids.size(0), keep, generator=torch.Generator().manual_seed(3))
    scored = mask[:, -keep:].bool()
    logps, _ = plain_fused(model, ids, mask, keep)
    want = grads_of(model, (logps.float() * weights).sum())
    pad = torch.zeros_like(ids[:, :1])
    shifted, _ = plain_fused(model, torch.cat([pad, ids], 1), torch.cat([pad, mask], 1), keep)
    ours, _ = shared_prefix_logps_and_entropies(model, ids, mask, keep, True, layout="packed")
    out = {}
    for name, got in (("TRL + 1 padding column", shifted), ("ours", ours)):
        grads = grads_of(model, (got.float() * weights).sum())
        diff = sum((grads[n].double() - want[n].double()).norm() ** 2 for n in want) ** 0.5
        total = sum(want[n].double().norm() ** 2 for n in want) ** 0.5
        delta = (got.float() - logps.float())[scored].abs()
        out[name] = (delta.max().item(), delta.mean().item(), (diff / total).item())
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bf16_within_trls_own_variation(tiny_model_path, attn):
    """bf16: ours against TRL's forward deviates no more than TRL's forward does from itself when the batch gets
    one more padding column (the envelope, measured here over three batches: max and mean |log-prob difference|,
    relative gradient difference), with 1.5x slack for which batch draws the largest rounding."""
    runs = [bf16_deviations(tiny_model_path, attn, seed) for seed in range(3)]
    envelope = [max(run["TRL + 1 padding column"][i] for run in runs) for i in range(3)]
    ours = [max(run["ours"][i] for run in runs) for i in range(3)]
    assert all(e > 0 for e in envelope)  # bf16 rounding does move TRL's own numbers
    for name, got, bound in zip(("max |dlogp|", "mean |dlogp|", "grad rel"), ours, envelope, strict=True):
        assert got <= 1.5 * bound, (name, got, bound)


@pytest.mark.slow
def test_embedded_model_forward(tmp_path):
    """The embedded SmolLM2-135M (fp32) with its one-shot prompts: log-probs and entropies."""
    from transformers import AutoTokenizer

    from trl_grpo_ext.models import resolve_model
    from trl_grpo_ext.task.data.prompts import build_prompt

    path = resolve_model("embedded")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load(path)
    questions = ("What is 3 + 4?", "Natalia sold 48 clips in April and half as many in May. How many in all?")
    distinct = [
        tokenizer.apply_chat_template(build_prompt(q, one_shot=True, chat=True), add_generation_prompt=True)
        for q in questions
    ]
    distinct = [d["input_ids"] if isinstance(d, dict) or hasattr(d, "keys") else d for d in distinct]
    g = torch.Generator().manual_seed(0)
    prompts = [distinct[0], distinct[1], distinct[0]]
    completions = [rand_tokens(6, model.config.vocab_size, g) for _ in prompts]
    ids, mask, keep = trl_layout(prompts, completions, [6, 4, 6])
    with torch.no_grad():  # gradients: the tiny-model tests (a backward here would double the test's time)
        logps, entropies = plain_fused(model, ids, mask, keep)
        got_logps, got_entropies = shared_prefix_logps_and_entropies(
            model, ids, mask, keep, compute_entropy=True, layout="packed"
        )
    torch.testing.assert_close(got_logps, logps, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(got_entropies, entropies, atol=LOGP_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------- per cycle
# The shared prompt parts of a whole generation batch encoded once per accumulation cycle (with gradients) and once
# per no-grad log-prob call, against the plain computation: real training runs (TRL's shuffled micro-batches,
# gradient accumulation over 3 micro-batches, SGD so parameters move linearly in the gradients).
CYCLE = dict(
    gradient_accumulation_steps=3,
    num_generations=4,
    max_steps=2,
    optim="sgd",
    learning_rate=0.05,
    max_grad_norm=0.0,
    gradient_checkpointing=False,  # TRL's default is on; with it each micro-batch shares on its own
)


class GradRecorder(TrainerCallback):
    """Each optimizer step's accumulated gradients (what the optimizer is about to apply)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def train_run(path, tmp_path, share, peft_config=None, **kwargs):
    trainer = make_trainer(path, tmp_path, peft_config=peft_config, share_prompt_prefix=share, **{**CYCLE, **kwargs})
    recorder = GradRecorder()
    trainer.add_callback(recorder)
    torch.manual_seed(0)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, recorder.grads, params, losses


def check_runs(shared, plain):
    _, grads, params, losses = shared
    _, want_grads, want_params, want_losses = plain
    assert len(grads) == len(want_grads) == CYCLE["max_steps"]
    for got, want in zip(grads, want_grads, strict=True):
        assert_grads_close(got, want)
    assert params.keys() == want_params.keys()
    for name in want_params:
        torch.testing.assert_close(params[name], want_params[name], atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def plain_dapo_run(tiny_model_path, tmp_path_factory):
    return train_run(tiny_model_path, tmp_path_factory.mktemp("plain-dapo"), share=False, loss_type="dapo")


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_cycle_context_trains_like_plain_and_encodes_each_prompt_once(tiny_model_path, tmp_path, plain_dapo_run):
    shared = train_run(tiny_model_path, tmp_path, share=True, loss_type="dapo")
    check_runs(shared, plain_dapo_run)
    trainer = shared[0]
    stats = trainer.prefix_sharing_stats
    # beta 0, num_iterations 1: the training forwards are the only log-prob calls; one context per optimizer step
    assert stats["cycle_contexts"] == CYCLE["max_steps"] and stats["call_contexts"] == 0
    assert stats["cycle_chunks"] == stats["shared_chunks"] == CYCLE["max_steps"] * CYCLE["gradient_accumulation_steps"]
    assert trainer._prefix_cycle is None  # the last cycle's graph was sent back and dropped
    # per cycle: each distinct prompt token of the generation batch once, plus each row's last prompt token
    rows = [
        row
        for mb in trainer._buffered_inputs
        for row in prompts_from_left_padded(mb["prompt_ids"], mb["prompt_mask"], mb["prompt_ids"].size(1))
    ]
    plan = plan_prefix(list(dict.fromkeys(map(tuple, rows))))
    assert len(rows) == 12 and len(plan.groups) == 3
    distinct_tokens = plan.shared_prompt_tokens - len(plan.groups)  # prefix + each rest, without the last tokens
    assert stats["context_tokens"] == CYCLE["max_steps"] * distinct_tokens
    assert stats["prompt_tokens_encoded"] == CYCLE["max_steps"] * (distinct_tokens + len(rows))
    assert stats["prompt_tokens"] == CYCLE["max_steps"] * sum(map(len, rows))
    # per step: prefix/shared_fraction (prompt tokens not encoded) and prefix/saved_tokens (TRL's padded tokens
    # minus those run: the context once, each row's last prompt token and unpadded completion)
    logged = [entry for entry in trainer.state.log_history if "prefix/shared_fraction" in entry]
    assert len(logged) == CYCLE["max_steps"]
    for entry in logged:
        assert entry["prefix/shared_fraction"] == pytest.approx(
            1 - (distinct_tokens + len(rows)) / sum(map(len, rows))
        )
        assert entry["prefix/saved_tokens"] > sum(map(len, rows)) - distinct_tokens - len(rows)


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_cycle_without_the_context_backward_fails(tiny_model_path, tmp_path, plain_dapo_run, monkeypatch):
    # the check above can fail: drop the context's gradient (the micro-batches' leaf gradients never reach the
    # parameters through the shared encoding) and the gradients are no longer the plain ones
    def drop(self):
        self._prefix_cycle = None

    monkeypatch.setattr(GRPOTrainer, "_flush_prefix_cycle", drop)
    shared = train_run(tiny_model_path, tmp_path, share=True, loss_type="dapo")
    assert shared[0].prefix_sharing_stats["cycle_contexts"] == CYCLE["max_steps"]
    with pytest.raises(AssertionError):
        assert_grads_close(shared[1][0], plain_dapo_run[1][0])


def test_a_run_repeats_bit_for_bit_at_a_fixed_count_and_across_counts(wide_model_path, tmp_path):
    """fp32 under sdpa, the shared prefix on (its cycle context): two runs at a fixed 2 threads log the same figures
    and end with the same weights, and so does a run at 1 thread (what the thread governor may switch to)."""

    def run(threads, name):
        torch.set_num_threads(threads)
        trainer, grads, params, _ = train_run(wide_model_path, tmp_path / name, share=True, loss_type="dapo")
        assert trainer.prefix_sharing_stats["cycle_contexts"] == CYCLE["max_steps"]
        logged = [{k: v for k, v in row.items() if "time" not in k and "per_second" not in k} for row in
                  trainer.state.log_history]  # fmt: skip
        return logged, grads, params

    before = torch.get_num_threads()
    try:
        runs = [run(2, "a"), run(2, "b"), run(1, "c")]
    finally:
        torch.set_num_threads(before)
    logged, grads, params = runs[0]
    assert len(grads) == CYCLE["max_steps"] and any("loss" in row for row in logged)
    for other_logged, other_grads, other_params in runs[1:]:
        assert other_logged == logged
        for got, want in zip(other_grads, grads, strict=True):
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        assert all(torch.equal(other_params[n], params[n]) for n in params)


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
@pytest.mark.parametrize(("loss_type", "beta", "iterations"), [("cispo", 0.04, 2), ("importance_sampling", 0.0, 2)])
def test_cycle_context_loss_types(tiny_model_path, tmp_path, loss_type, beta, iterations):
    kwargs = dict(loss_type=loss_type, beta=beta, num_iterations=iterations)
    shared = train_run(tiny_model_path, tmp_path / "shared", share=True, **kwargs)
    check_runs(shared, train_run(tiny_model_path, tmp_path / "plain", share=False, **kwargs))
    stats = shared[0].prefix_sharing_stats
    # num_iterations 2: two cycles on one generation batch, each encoding the context with its own parameters
    assert stats["cycle_contexts"] == CYCLE["max_steps"]
    # old (num_iterations 2) and reference (beta > 0) log-probs: one context per call over the generation batch
    calls = CYCLE["max_steps"] // iterations * ((iterations > 1) + (beta > 0))
    assert stats["call_contexts"] == calls and stats["call_chunks"] == 3 * calls


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_cycle_context_lora(tiny_model_path, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    kwargs = dict(loss_type="dapo", beta=0.04, num_iterations=2)  # the reference is the adapter switched off
    shared = train_run(tiny_model_path, tmp_path / "shared", share=True, peft_config=lora, **kwargs)
    check_runs(shared, train_run(tiny_model_path, tmp_path / "plain", share=False, peft_config=lora, **kwargs))
    assert shared[0].prefix_sharing_stats["cycle_contexts"] == CYCLE["max_steps"]


@pytest.mark.usefixtures("packed_layout")  # at the tiny model's shapes the cost model would pick TRL's padded rows
def test_cycle_context_falls_back_per_micro_batch(tiny_model_path, tmp_path, caplog, monkeypatch):
    # gradient checkpointing drops the cache in a forward with gradients: each micro-batch shares on its own.
    # The reason is logged once per process: forget what earlier tests of this process logged.
    monkeypatch.setattr("trl_grpo_ext.prefix.support._LOGGED", set())
    with caplog.at_level("WARNING", logger="trl_grpo_ext.prefix"):
        trainer, *_ = train_run(tiny_model_path, tmp_path, share=True, gradient_checkpointing=True, max_steps=1)
    stats = trainer.prefix_sharing_stats
    assert stats["cycle_contexts"] == 0 and stats["shared_chunks"] == CYCLE["gradient_accumulation_steps"]
    assert any("gradient checkpointing drops the cache" in r.getMessage() for r in caplog.records)
    trainer.args.gradient_checkpointing = False
    assert trainer._cycle_unsupported_reason(grad=True) is None
    trainer.args.steps_per_generation = 1
    assert "steps_per_generation" in trainer._cycle_unsupported_reason(grad=True)
    assert trainer._cycle_unsupported_reason(grad=False) is None  # no-grad calls don't care
    trainer.share_prompt_prefix_across_microbatches = False
    assert trainer._cycle_unsupported_reason(grad=False) == ""


CHUNKS = (slice(0, 4), slice(4, None))


def check_context_forward(model, ids, mask, keep, prompts, weights, logps, entropies, want, budget):
    """`encode_prompt_context` + `context_logps_and_entropies` over two chunks against the plain forward's
    log-probs, entropies and gradients (through detached leaves, sent back through the context once)."""
    model.zero_grad()
    context = encode_prompt_context(model, prompts, max_packed_tokens=budget)
    assert (len(context.prefix_slots) > 1) == (budget is not None and budget < 4096)
    leaves = context.with_kv(
        [k.detach().requires_grad_() for k in context.keys], [v.detach().requires_grad_() for v in context.values]
    )
    got_logps, got_entropies = [], []
    for rows in CHUNKS:
        lp, ent = context_logps_and_entropies(model, leaves, ids[rows], mask[rows], keep, True, budget)
        ((lp * weights[rows]).sum() + ent.sum()).backward()
        got_logps.append(lp.detach())
        got_entropies.append(ent.detach())
    torch.autograd.backward(context.keys + context.values, [leaf.grad for leaf in leaves.keys + leaves.values])
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(torch.cat(got_logps), logps, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_entropies), entropies, atol=LOGP_ATOL, rtol=0)
    assert_grads_close(got, want)
    # a prompt the context doesn't hold: the caller falls back
    other = trl_layout([[5, 6, 7]], [[3, 4]], [2])
    assert context_logps_and_entropies(model, context, other[0], other[1], other[2]) is None


@pytest.mark.parametrize(
    ("attn", "budget", "hole"), [("sdpa", None, False), ("sdpa", None, True), ("eager", 30, True)]
)
def test_context_forward_equals_plain(tiny_model_path, attn, budget, hole):
    """The context path (segment attention over stored keys under sdpa; bins of gathered stored slots under eager,
    context bins split) against the plain forward."""
    model = load(tiny_model_path, attn, temperature=0.7)
    prompts, ids, mask, keep, weights, logps, entropies, want = reference(model, hole)
    check_context_forward(model, ids, mask, keep, prompts, weights, logps, entropies, want, budget)
