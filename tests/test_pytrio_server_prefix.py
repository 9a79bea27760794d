"""Local PyTRIO server engine: prompt-prefix sharing, through the prefix engine the TRL path uses, is exact.

`forward_backward` data that share a prefix encode it once (`trl_grpo_ext.prefix`: `plan_token_rows`, `pack_rows`,
one packed forward); per-token log-probs must match the unshared computation to 1e-4 absolute and gradients to 1e-5
relative in fp32, for every built-in loss, with and without ``auto_shift``, with a head common to all prompts
(level 1) and without (each group's prompt once, level 2), under sdpa and eager; in bf16 autocast to the bounds of
`precision_tolerance.BF16`; a batch with nothing shared, or one the cost model keeps padded, must give exactly the unshared result
in either precision; greedy samples (prompt encoded once, KV expanded to the rows) must equal ``model.generate``.

Every engine here names its precision (``bf16=False`` / ``True``), so the results do not follow the machine's
bf16 detection.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from precision_tolerance import Tolerance, assert_grads_close, tolerance

from trl_grpo_ext.prefix import plan_token_rows
from trl_grpo_ext.pytrio_server import forward as server_forward
from trl_grpo_ext.pytrio_server.adapters import LoraSettings
from trl_grpo_ext.pytrio_server.engine import ModelEngine
from trl_grpo_ext.pytrio_server.forward import ForwardDatum
from trl_grpo_ext.pytrio_server.loss_fns import parse_loss

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def engine(request, tiny_model_path):
    return ModelEngine(tiny_model_path, min_shared_prefix=4, bf16=request.param)


def _datum(tokens, prompt_len, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    targets = tokens[1:] + [tokens[0]]
    advantages = [0.0] * prompt_len + (torch.randn(n - prompt_len, generator=g) * 0.5).tolist()
    old = (-torch.rand(n, generator=g) * 3).tolist()
    weights = [0.0] * prompt_len + [1.0] * (n - prompt_len)
    return ForwardDatum(tokens, targets, weights, old, advantages)


def _grpo_batch(head=True):
    """Two prompt groups of 3 completions (different lengths, a shared system-like head unless not `head`) and one
    unrelated row."""
    system = [3, 17, 29, 41, 5, 8]
    prompts = [system + [11, 12, 13, 14, 15], (system if head else [4] + system[1:]) + [21, 22, 23]]
    data, seed = [], 0
    for p in prompts:
        for length in (4, 7, 2):
            seed += 1
            completion = [(7 * seed + 3 * j) % 60 + 1 for j in range(length)]
            data.append(_datum(p + completion, len(p), seed))
    data.insert(4, _datum([44, 45, 46, 47, 48, 49, 50], 3, 99))  # groups need not be adjacent
    return data


def _fresh_run(engine, run_id):
    engine.drop_run(run_id)
    run = engine.create_run(run_id, LoraSettings(rank=4, seed=7))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B = 0 at init would make every A-gradient zero: use random adapter weights
        for _, p in run.params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return run


def _run(engine, data, loss, auto_shift, share):
    engine.share_prefix = share
    try:
        run = _fresh_run(engine, f"r_{share}")
        outputs, metrics = engine.forward(run.run_id, data, parse_loss(loss, None), backward=True,
                                          auto_shift=auto_shift)  # fmt: skip
        grads = {n: p.grad.detach().clone() for n, p in run.params if p.grad is not None}
        return outputs, metrics, grads
    finally:
        engine.share_prefix = True


def test_grouping_finds_the_shared_prompts():
    data = _grpo_batch()
    rows = plan_token_rows([d.tokens for d in data], 4)
    assert rows.shared == (0, 1, 2, 3, 5, 6) and rows.plain == (4,)
    assert rows.plan.groups == ((0, 1, 2), (3, 4, 5)) and [len(p) for p in rows.plan.prompts] == [12] * 3 + [10] * 3
    assert rows.plan.prefix_length == 6  # the system-like head both prompts start with: level 1
    assert plan_token_rows([d.tokens for d in _grpo_batch(head=False)], 4).plan.prefix_length == 0
    # no group shares 12 tokens: nothing planned
    assert plan_token_rows([d.tokens for d in data], 12).plan is None


def test_the_server_shares_through_the_prefix_engine(engine, prefix_engine_calls, packed_layout):
    """The server has no prefix code of its own: its forward plans with `plan_token_rows` and runs `pack_rows`'
    layout, once per chunk."""
    for name in ("_pieces", "_head_length", "_shared_target_logprobs", "_suffix_target_logprobs"):
        assert not hasattr(engine, name), name
    assert not hasattr(server_forward, "_copy_cache") and not hasattr(server_forward, "_common_prefix")
    _run(engine, _grpo_batch(), "ppo", False, share=True)
    assert prefix_engine_calls == {"plan": 1, "packed": 1}
    _run(engine, _grpo_batch(), "ppo", False, share=False)
    assert prefix_engine_calls == {"plan": 1, "packed": 1}


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("auto_shift", [False, True])
@pytest.mark.parametrize("loss", LOSSES)
def test_shared_prefix_forward_backward_equals_unshared(
    engine, prefix_engine_calls, packed_layout, loss, auto_shift, head
):
    data = _grpo_batch(head)
    shared_out, shared_metrics, shared_grads = _run(engine, data, loss, auto_shift, share=True)
    assert prefix_engine_calls["packed"] == 1
    plain = _run(engine, data, loss, auto_shift, share=False)
    _assert_close(tolerance(engine.autocast_bf16), (shared_out, shared_metrics, shared_grads), plain)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_shared_prefix_forward_backward_equals_unshared_under_eager(
    tiny_model_path, prefix_engine_calls, packed_layout, bf16
):
    eager = ModelEngine(tiny_model_path, min_shared_prefix=4, bf16=bf16)
    eager.base.set_attn_implementation("eager")
    data = _grpo_batch()
    shared = _run(eager, data, "importance_sampling", True, share=True)
    assert prefix_engine_calls["packed"] == 1
    plain = _run(eager, data, "importance_sampling", True, share=False)
    _assert_close(tolerance(bf16), shared, plain)


def _assert_close(tol: Tolerance, shared, plain):
    (shared_out, shared_metrics, shared_grads), (plain_out, plain_metrics, plain_grads) = shared, plain
    assert shared_metrics["token_count"] == plain_metrics["token_count"]
    assert shared_metrics["loss_sum"] == pytest.approx(plain_metrics["loss_sum"], rel=tol.loss_sum, abs=tol.loss_sum)
    for a, b in zip(shared_out, plain_out, strict=True):
        assert a["logprobs"].shape == b["logprobs"].shape
        assert abs(a["logprobs"] - b["logprobs"]).max() <= tol.logprob
        assert abs(a["elementwise_loss"] - b["elementwise_loss"]).max() <= tol.logprob
    assert_grads_close(shared_grads, plain_grads, tol)
    assert sum(float(g.norm()) > 0 for g in plain_grads.values()) > len(plain_grads) // 2


def _assert_identical(engine, data):
    shared_out, shared_metrics, shared_grads = _run(engine, data, "ppo", False, share=True)
    plain_out, plain_metrics, plain_grads = _run(engine, data, "ppo", False, share=False)
    assert shared_metrics == plain_metrics
    for a, b in zip(shared_out, plain_out, strict=True):
        assert (a["logprobs"] == b["logprobs"]).all() and (a["elementwise_loss"] == b["elementwise_loss"]).all()
    for name, grad in plain_grads.items():
        assert torch.equal(shared_grads[name], grad)


def test_nothing_shared_gives_exactly_the_unshared_result(engine, prefix_engine_calls):
    data = [_datum([i + 1, i + 9, i + 20, 30, 31, 32, 33, 34], 2, i) for i in range(4)]  # differing first tokens
    assert plan_token_rows([d.tokens for d in data], 4).plan is None
    _assert_identical(engine, data)
    assert prefix_engine_calls == {"plan": 1, "packed": 0}


def test_padded_by_the_cost_model_gives_exactly_the_unshared_result(engine, prefix_engine_calls, monkeypatch):
    monkeypatch.setattr("trl_grpo_ext.prefix.packing.packed_is_cheaper", lambda packed, padded: False)
    _assert_identical(engine, _grpo_batch())
    assert prefix_engine_calls == {"plan": 1, "packed": 0}


def test_greedy_samples_equal_model_generate(engine):
    prompt = [3, 17, 29, 41, 5, 8, 11, 12]
    results = engine.sample(None, prompt, num_samples=3, max_tokens=10, temperature=0.0)
    adapters_off = engine.peft.disable_adapter() if engine.peft is not None else contextlib.nullcontext()
    with torch.no_grad(), adapters_off:
        out = engine.base.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=10,
            do_sample=False, eos_token_id=sorted(engine.stop_ids) or None, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(prompt) :].tolist()
    stop = next((i for i, t in enumerate(expected) if t in engine.stop_ids), None)
    expected = expected[: stop + 1] if stop is not None else expected
    assert [r.tokens for r in results] == [expected] * 3


def test_cost_model_packs_grpo_groups_at_the_embedded_model_shapes():
    """The server's sharing at real shapes rests on the cost model: SmolLM2-135M's shapes (no weights needed), the
    batch of bench/pytrio_server.py (3 prompts sharing a 58-token head, 4 completions each, 117 + 48 tokens) packs;
    rows that share only a few tokens of long completions stay padded."""
    import types

    from transformers import LlamaConfig

    from trl_grpo_ext.prefix import pack_rows
    from trl_grpo_ext.prefix.packing import fit_to, packed_beats_padded

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152)  # fmt: skip
    config._attn_implementation = "sdpa"
    model = types.SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)]))
    g = torch.Generator().manual_seed(0)

    def packs(prompts, group, completion):
        sequences = [p + torch.randint(5, 49000, (completion,), generator=g).tolist() for p in prompts
                     for _ in range(group)]  # fmt: skip
        rows = plan_token_rows(sequences, 8)
        packed = fit_to(pack_rows(rows.plan, rows.completions(sequences), attn_implementation="sdpa"), model)
        lengths = [len(sequences[i]) for i in rows.shared]
        return packed_beats_padded(model, packed, lengths, max(lengths), every_position_scored=True)

    head = list(range(100, 158))
    assert packs([head + list(range(1000 * i, 1000 * i + 59)) for i in range(1, 4)], 4, 48)
    assert not packs([list(range(200, 208)) + list(range(1000 * i, 1000 * i + 4)) for i in range(1, 3)], 2, 400)
