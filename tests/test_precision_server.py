"""The local PyTRIO server follows the precision rule (`trl_grpo_ext.precision`): bf16 autocast in forward/backward
and sampling where chosen (frozen base linears in bf16, LoRA weights and Adam state fp32), fp32 untouched elsewhere;
the PyTRIO loop logs the sampler/trainer mismatch from the same function as the TRL path."""

import math

import pytest
import torch

from trl_grpo_ext.grpo.losses import SAMPLER_MISMATCH_KEYS
from trl_grpo_ext.precision import ENV_CPU_BF16

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def _engine(path, monkeypatch, units: bool, **kwargs):
    from trl_grpo_ext.pytrio.server.engine import ModelEngine

    monkeypatch.setenv(ENV_CPU_BF16, "1" if units else "0")
    return ModelEngine(path, **kwargs)


def _step(engine, run_id="r"):
    """Sample a completion on the base model, then one forward_backward (importance_sampling against the
    sampler's log-probs) and an optimizer step on a fresh LoRA run; returns (sampled, logprobs, outputs, run)."""
    from trl_grpo_ext.pytrio.server.adapters import LoraSettings
    from trl_grpo_ext.pytrio.server.forward import ForwardDatum
    from trl_grpo_ext.pytrio.server.loss_fns import parse_loss

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


def test_forced_bf16_server_trains_and_samples_in_autocast(tiny_model_path, monkeypatch):
    engine = _engine(tiny_model_path, monkeypatch, units=True)
    assert engine.precision.bf16 is True and engine.autocast_bf16
    base = engine.base.model.layers[0].mlp.down_proj
    assert base.weight.dtype == torch.bfloat16  # frozen base: bf16, as autocast would cast it
    assert engine.base.model.embed_tokens.weight.dtype == torch.float32
    seen = []
    handle = engine.base.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    sampled, old, advantages, trained, run = _step(engine)
    handle.remove()
    assert seen and set(seen) == {torch.bfloat16}  # sampling and training ran in bf16
    assert {p.dtype for _, p in run.params} == {torch.float32}  # LoRA weights: fp32 master weights
    from trl_grpo_ext.pytrio.server.adapters import LoraSettings

    second = engine.create_run("r2", LoraSettings(rank=4, seed=7))  # PEFT's add_adapter, not get_peft_model
    assert {p.dtype for _, p in second.params} == {torch.float32}
    moments = [v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    # the server's trainer log-probs of the sampled tokens: the sampler's to bf16 rounding
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
    from trl_grpo_ext.pytrio.server import ServerConfig

    with pytest.raises(ValueError, match="bf16='sometimes' must be auto, true or false"):
        ServerConfig(model=tiny_model_path, bf16="sometimes")


def test_loop_logs_the_mismatch_of_a_bf16_server(tiny_model_path, monkeypatch):
    """The PyTRIO loop's loss metrics carry the sampler/trainer mismatch (`grpo.losses.sampler_correction`)."""
    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.pytrio.datums import shifted_sequences
    from trl_grpo_ext.pytrio.loop import TokenRows, make_custom_loss

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
