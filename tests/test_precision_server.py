"""The local PyTRIO server follows the precision rule (`trl_grpo_ext.cpu.precision`): bf16 autocast in forward/backward
where chosen (LoRA weights and Adam state fp32), sampling in fp32 unless ``bf16_sampling`` (then the frozen base
linears are stored in bf16 and every path runs in autocast), fp32 untouched elsewhere; the PyTRIO loop logs the
sampler/trainer mismatch from the same function as the TRL path."""

import math

import pytest
import torch

from trl_grpo_ext.cpu.precision import ENV_CPU_BF16
from trl_grpo_ext.grpo.losses import SAMPLER_MISMATCH_KEYS

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def _engine(path, monkeypatch, units: bool, **kwargs):
    from trl_grpo_ext.pytrio_server.engine import ModelEngine

    monkeypatch.setenv(ENV_CPU_BF16, "1" if units else "0")
    return ModelEngine(path, **kwargs)


def _step(engine, run_id="r"):
    """Sample a completion on the base model, then one forward_backward (importance_sampling against the
    sampler's log-probs) and an optimizer step on a fresh LoRA run; returns (sampled, logprobs, outputs, run)."""
    from trl_grpo_ext.pytrio_server.adapters import LoraSettings
    from trl_grpo_ext.pytrio_server.forward import ForwardDatum
    from trl_grpo_ext.pytrio_server.loss_fns import parse_loss

    prompt = [3, 17, 29, 41, 5, 8, 11]
    sampled = engine.sample(None, prompt, num_samples=1, max_tokens=6, temperature=1.0, seed=3)[0]
    run = engine.create_run(run_id, LoraSettings(rank=4, seed=7))
    tokens = prompt + sampled.tokens
    n, p = len(tokens), len(prompt)
    targets = tokens[1:] + [tokens[0]]
    old = [0.0] * (p - 1) + list(sampled.logprobs) + [0.0]
    advantages = [0.0] * (p - 1) + [1.0] * len(sampled.tokens) + [0.0]
    datum = ForwardDatum(tokens, targets, None, old, advantages)
    outputs, _ = engine.forward(
        run_id, [datum], parse_loss("importance_sampling", None), backward=True, auto_shift=False
    )
    engine.optim_step(run_id, ADAM)
    return sampled, old, advantages, outputs[0]["logprobs"][:n], run


def _dtypes_seen(engine, work):
    """(dtypes of layer 0's MLP output during `work()`, what `work` returned)."""
    seen = []
    handle = engine.base.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        result = work()
    finally:
        handle.remove()
    return set(seen), result


def _assert_fp32_master_weights(engine, run):
    from trl_grpo_ext.pytrio_server.adapters import LoraSettings

    assert {p.dtype for _, p in run.params} == {torch.float32}  # LoRA weights: fp32 master weights
    second = engine.create_run("r2", LoraSettings(rank=4, seed=7))  # PEFT's add_adapter, not get_peft_model
    assert {p.dtype for _, p in second.params} == {torch.float32}
    moments = [v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert moments and {v.dtype for v in moments} == {torch.float32}


def test_forced_bf16_server_trains_in_autocast_and_samples_in_fp32(tiny_model_path, monkeypatch):
    engine = _engine(tiny_model_path, monkeypatch, units=True)
    assert engine.precision.bf16 is True and engine.autocast_bf16 and not engine.sample_bf16
    assert {p.dtype for p in engine.base.parameters()} == {torch.float32}
    prompt = [3, 17, 29, 41, 5, 8, 11]
    sampled_dtypes, _ = _dtypes_seen(engine, lambda: engine.sample(None, prompt, num_samples=2, max_tokens=4, seed=1))
    assert sampled_dtypes == {torch.float32}  # sampling: fp32, batch-invariant
    dtypes, (sampled, old, advantages, trained, run) = _dtypes_seen(engine, lambda: _step(engine))
    assert torch.bfloat16 in dtypes  # forward_backward in bf16 autocast
    _assert_fp32_master_weights(engine, run)
    # the server's bf16 trainer log-probs of the tokens its fp32 sampler drew: equal to bf16 rounding
    counted = [i for i, a in enumerate(advantages) if a]
    assert max(abs(trained[i] - old[i]) for i in counted) < 0.05


def test_bf16_sampling_stores_the_base_in_bf16_and_every_path_computes_in_autocast(tiny_model_path, monkeypatch):
    """With ``bf16_sampling`` the frozen base linears are bf16 and each path works on them: sampling groups,
    prompt log-probs (compute_logprobs), forward_backward and a direct ``generate`` of the base model."""
    engine = _engine(tiny_model_path, monkeypatch, units=True, bf16_sampling=True)
    fp32 = _engine(tiny_model_path, monkeypatch, units=False)
    assert engine.sample_bf16 and engine.base.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert engine.base.model.embed_tokens.weight.dtype == torch.float32  # the lookup is not autocast
    prompt = [3, 17, 29, 41, 5, 8, 11]
    dtypes, (sampled, old, advantages, trained, run) = _dtypes_seen(engine, lambda: _step(engine))
    assert dtypes == {torch.bfloat16}  # sampling and training ran in bf16
    _assert_fp32_master_weights(engine, run)
    group = engine.sample(None, prompt, num_samples=4, max_tokens=5, seed=2)
    assert len(group) == 4 and all(0 < len(r.tokens) <= 5 for r in group)
    # the sampler's log-probs are bf16 computations of the fp32 model's: equal to bf16 rounding (2**-7 relative on
    # O(1) logits, a few roundings per log-prob through two layers)
    got, _ = engine.prompt_logprobs(None, prompt)
    want, _ = fp32.prompt_logprobs(None, prompt)
    assert max(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) < 8 * torch.finfo(torch.bfloat16).eps
    with torch.no_grad():  # a direct call of the base model meets bf16 weights: it runs in autocast too
        out = engine.base.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, len(prompt) + 3)
    counted = [i for i, a in enumerate(advantages) if a]
    assert max(abs(trained[i] - old[i]) for i in counted) < 0.05


def test_detection_off_keeps_the_fp32_server(tiny_model_path, monkeypatch):
    engine = _engine(tiny_model_path, monkeypatch, units=False)
    assert engine.precision.bf16 is False and not engine.autocast_bf16
    assert {p.dtype for p in engine.base.parameters()} == {torch.float32}
    forced = _engine(tiny_model_path, monkeypatch, units=True, bf16=False)  # bf16: false wins over the units
    assert not forced.autocast_bf16
    a = _step(engine)
    b = _step(forced)
    assert a[0].tokens == b[0].tokens and a[0].logprobs == b[0].logprobs  # the same fp32 path, bit for bit
    assert list(a[3]) == list(b[3])


def test_server_config_rejects_a_bad_bf16(tiny_model_path):
    from trl_grpo_ext.pytrio_server import ServerConfig

    with pytest.raises(ValueError, match="bf16='sometimes' must be auto, true or false"):
        ServerConfig(model=tiny_model_path, bf16="sometimes")


def test_loop_logs_the_mismatch_of_a_bf16_server(tiny_model_path, monkeypatch):
    """The PyTRIO loop's loss metrics carry the sampler/trainer mismatch (`grpo.losses.sampler_correction`)."""
    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.pytrio.datums import shifted_sequences
    from trl_grpo_ext.pytrio.loss import make_custom_loss
    from trl_grpo_ext.pytrio.types import TokenRows

    engine = _engine(tiny_model_path, monkeypatch, units=True)
    sampled, _old, _adv, trained, _run = _step(engine)
    prompt = [3, 17, 29, 41, 5, 8, 11]
    rows = TokenRows()
    rows.add(shifted_sequences(prompt, sampled.tokens, sampled.logprobs, 1.0))
    record = {}
    config = PyTrioGRPOConfig(
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=2,
        reward_funcs=["boxed"],
        loss_type="importance_sampling",
    )
    shifted = list(trained)[:-1]  # the loop's datum drops the last position (nothing to predict)
    make_custom_loss(config, rows, record)(None, [torch.tensor(shifted, dtype=torch.float32)])
    for key in SAMPLER_MISMATCH_KEYS:
        assert math.isfinite(record[key]), key
    assert 0 <= record["sampling/sampler_kl"] < 1e-2
    assert record["sampling/is_ratio_raw/min"] <= 1.0 + 5e-2 and record["sampling/is_ratio_raw/max"] >= 1.0 - 5e-2
