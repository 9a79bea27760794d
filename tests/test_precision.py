"""Precision by hardware (`trl_grpo_ext.cpu.precision`): detection, `bf16: auto`, the sampler correction's maths, and
the TRL path's bf16 autocast (fp32 master weights and optimizer state) with the mismatch logged; fp32 unchanged."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import trl
from datasets import Dataset

from trl_grpo_ext.cpu.precision import (
    ENV_CPU_BF16,
    ONEDNN_CACHE_VARIABLES,
    cpu_bf16_units,
    parse_bf16_setting,
    resolve_precision,
)
from trl_grpo_ext.grpo.losses import SAMPLER_MISMATCH_KEYS, sampler_correction
from trl_grpo_ext.trl.config import GRPOConfig

PROMPTS = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(8)]
COMMON = dict(
    report_to="none",
    use_cpu=True,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    gradient_checkpointing=False,
    seed=0,
)


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


@pytest.fixture
def units(monkeypatch):
    """Force the detection: ``units(True)`` / ``units(False)``."""

    def force(on: bool):
        monkeypatch.setenv(ENV_CPU_BF16, "1" if on else "0")

    return force


# ------------------------------------------------------------------ detection and resolution
def test_detection_forced_on_and_off(units):
    units(True)
    assert cpu_bf16_units()[0] is True
    units(False)
    on, why = cpu_bf16_units()
    assert on is False and ENV_CPU_BF16 in why


def test_detection_reads_torchs_cpu_capabilities(monkeypatch):
    monkeypatch.delenv(ENV_CPU_BF16, raising=False)
    caps = dict(torch.cpu.get_capabilities())
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**caps, "amx_bf16": True})
    on, why = cpu_bf16_units()
    assert on and "amx_bf16" in why
    stripped = {k: v for k, v in caps.items() if k not in ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: stripped)
    assert cpu_bf16_units()[0] is False


def test_settings_and_bad_values(units):
    units(True)
    assert resolve_precision("auto", on_cpu=True).bf16 is True
    assert resolve_precision(None, on_cpu=True).bf16 is True  # TRL's None is auto here
    assert resolve_precision(False, on_cpu=True).bf16 is False
    assert resolve_precision("true", on_cpu=True).bf16 is True
    assert resolve_precision("auto", on_cpu=False).bf16 is None  # off the CPU: TRL's default decides
    units(False)
    assert resolve_precision("auto", on_cpu=True).bf16 is False
    assert resolve_precision(True, on_cpu=True).bf16 is True  # forced
    for bad in ("maybe", 2, 0.5):
        with pytest.raises(ValueError, match="must be auto, true or false"):
            parse_bf16_setting(bad)


# A fresh process resolves a precision, then runs bf16 matmuls of 134 shapes and the first shape again, and prints
# whether torch sends bf16 matmuls to oneDNN on this CPU.
ONEDNN_PROBE = r"""
import sys
import torch
from trl_grpo_ext.cpu.precision import resolve_precision

resolve_precision(sys.argv[1], on_cpu=True)
weight = torch.randn(64, 64)
for rows in [*range(32, 166), 32]:  # torch sends bf16 matmuls of 17 rows and more to oneDNN
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(torch.randn(rows, 64), weight)
print("mkldnn_bf16", torch.ops.mkldnn._is_mkldnn_bf16_supported())
"""


@pytest.mark.parametrize(
    "setting, preset, expect",
    [("true", None, "cache_miss"), ("false", None, "cache_hit"), ("true", "1024", "cache_hit")],
    ids=["bf16-capped", "fp32-untouched", "bf16-user-setting-kept"],
)
def test_a_bf16_cpu_run_caps_onednns_caches(setting, preset, expect):
    """oneDNN's matmul cache, seen in its verbose log: after a bf16 precision is resolved the first shape is built
    again after 134 others (capped at 32 entries); an fp32 run, or a user's own setting, keeps it cached."""
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env.update(ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1")
    if preset is not None:
        env.update(dict.fromkeys(ONEDNN_CACHE_VARIABLES, preset))
    done = subprocess.run(
        [sys.executable, "-c", ONEDNN_PROBE, setting], env=env, capture_output=True, text=True, check=True
    )
    creates = [line for line in done.stdout.splitlines() if "create:cache_" in line and ",matmul," in line]
    if "mkldnn_bf16 False" in done.stdout:  # torch runs bf16 matmuls without oneDNN here: no cache to grow
        assert creates == []
        return
    assert len(creates) == 135, done.stdout[-2000:]
    assert ",32x64:64x64," in creates[-1] and f"create:{expect}" in creates[-1], creates[-1]


def test_config_resolves_auto_before_trl(units, monkeypatch):
    units(False)
    args = GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    assert args.bf16 is False and args.precision.setting == "auto" and "fp32" in args.precision.line()
    units(True)
    args = GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    assert args.bf16 is True and args.to_dict()["bf16"] is True
    assert args.precision.line().startswith("precision: bf16 autocast (fp32 master weights")
    if not torch.cuda.is_available():  # transformers trains bf16 on the CPU only with use_cpu: auto stays valid
        args = GRPOConfig(output_dir="unused", report_to="none")
        assert args.bf16 is False and "use_cpu: true" in args.precision.reason
    with pytest.raises(ValueError, match=r"^invalid GRPOConfig: bf16='often' must be auto, true or false$"):
        GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16="often")
    monkeypatch.setenv(ENV_CPU_BF16, "perhaps")
    with pytest.raises(ValueError, match=ENV_CPU_BF16):
        GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)


def test_recipe_parses_bf16_auto_and_flags(units, tmp_path):
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    units(False)
    base = ["--output_dir", str(tmp_path / "o"), "--use_cpu", "true", "--report_to", "none"]
    _, args, _ = parse_recipe_args([*base, "--bf16", "auto", "--model_name_or_path", "x"])
    assert args.bf16 is False and args.precision.setting == "auto"
    _, args, _ = parse_recipe_args([*base, "--bf16", "true", "--model_name_or_path", "x"])
    assert args.bf16 is True and args.precision.setting == "true"
    with pytest.raises(ValueError, match="bf16='sometimes'"):
        parse_recipe_args([*base, "--bf16", "sometimes", "--model_name_or_path", "x"])


# ------------------------------------------------------------------ the correction's maths, by hand
def test_sampler_correction_against_a_hand_computation():
    trainer = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.5, -0.5]])
    sampler = torch.tensor([[-1.1, -0.5, -9.0], [-0.5, -3.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # counted tokens (mask, sampler not NaN): d = trainer - sampler
    d = [0.1, -1.5, 0.0, 2.5]
    r = [math.exp(x) for x in d]
    weights, m = sampler_correction(trainer, sampler, mask, "token_truncate", None, 3.0)
    want = [[r[0], r[1], 1.0], [r[2], 3.0, 1.0]]
    torch.testing.assert_close(weights, torch.tensor(want))
    assert m["sampling/is_ratio_raw/mean"].item() == pytest.approx(sum(r) / 4)
    assert m["sampling/is_ratio_raw/min"].item() == pytest.approx(min(r))
    assert m["sampling/is_ratio_raw/max"].item() == pytest.approx(max(r))
    assert m["sampling/is_ratio_truncated_frac"].item() == pytest.approx(1 / 4)  # e^2.5 > 3
    k3 = [math.exp(x) - 1 - x for x in d]
    assert m["sampling/sampler_kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert set(m) == set(SAMPLER_MISMATCH_KEYS)

    weights, m = sampler_correction(trainer, sampler, mask, "token_mask", 0.5, 3.0)
    torch.testing.assert_close(weights, torch.tensor([[r[0], 0.0, 1.0], [r[2], 0.0, 1.0]]))
    assert m["sampling/is_ratio_truncated_frac"].item() == pytest.approx(2 / 4)

    seq = [math.exp(0.1 - 1.5), math.exp(2.5)]
    weights, m = sampler_correction(trainer, sampler, mask, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(weights, torch.tensor([[seq[0]], [3.0]]))
    assert m["sampling/is_ratio_raw/max"].item() == pytest.approx(seq[1])
    weights, _ = sampler_correction(trainer, sampler, mask, "sequence_mask", None, 3.0)
    torch.testing.assert_close(weights, torch.tensor([[seq[0]], [0.0]]))
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        sampler_correction(trainer, sampler, mask, "token_clip")


# ------------------------------------------------------------------ the TRL path
def _trainer(path, tmp_path, **kwargs):
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    return GRPOTrainer(path, [length_reward], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


@pytest.mark.slow
def test_bf16_auto_trains_in_autocast_with_fp32_master_weights_and_logs_the_mismatch(tiny_model_path, tmp_path, units):
    units(True)
    trainer = _trainer(tiny_model_path, tmp_path, max_steps=2, vllm_importance_sampling_mode="token_truncate")
    assert trainer.args.bf16 is True and trainer.args.precision.setting == "auto"
    seen = {}  # dtype of a linear layer's output in the generation and in the loss
    layer = trainer.model.model.layers[0].mlp.down_proj

    def record(module, inputs, output):
        seen.setdefault("grad" if torch.is_grad_enabled() else "no_grad", output.dtype)

    handle = layer.register_forward_hook(record)
    trainer.train()
    handle.remove()
    assert seen == {"no_grad": torch.bfloat16, "grad": torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # master weights
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert states and {v.dtype for v in states} == {torch.float32}  # Adam's moments
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    # deterministic in bf16 too: the same inputs and threads give the same figures
    again = _trainer(tiny_model_path, tmp_path, max_steps=2, vllm_importance_sampling_mode="token_truncate")
    again.train()
    rows_again = [row for row in again.state.log_history if "loss" in row]
    assert [{k: v for k, v in r.items() if k != "step_time"} for r in rows] == [
        {k: v for k, v in r.items() if k != "step_time"} for r in rows_again
    ]
    for row in rows:
        for key in SAMPLER_MISMATCH_KEYS:
            assert math.isfinite(row[key]), key
        assert (
            row["sampling/is_ratio_raw/min"] <= row["sampling/is_ratio_raw/mean"] <= row["sampling/is_ratio_raw/max"]
        )
        assert row["sampling/sampler_kl"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [True, False])
def test_the_loss_forward_recasts_the_weights_in_bf16_on_the_cpu_only(tiny_model_path, tmp_path, units, bf16):
    """bf16 on the CPU: the loss forward runs in `recast_weights` (autocast's cache off) and gives TRL's own gradients
    to the bit; fp32 runs TRL's context unchanged."""
    from trl_grpo_ext.trl.training_precision import RecastWeightsMixin

    units(True)
    trainer = _trainer(tiny_model_path, tmp_path, bf16=bf16)
    assert trainer._recasts_weights() is bf16
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": PROMPTS[i]} for i in range(4)])
    seen = []
    handle = trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, output: seen.append(torch.is_autocast_cache_enabled())
    )

    def grads(context):
        trainer.model.zero_grad(set_to_none=True)
        with context:
            loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    ours = grads(trainer.compute_loss_context_manager())
    theirs = grads(super(RecastWeightsMixin, trainer).compute_loss_context_manager())
    handle.remove()
    assert seen == [not bf16, True]
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def _generation_batch(trainer):
    """A generation batch (2 prompts x 4), the forward arguments of its completions, and the trainer's own bf16
    log-probs of them."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": PROMPTS[i]} for i in range(2) for _ in range(4)])
    mask = inputs["completion_mask"]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    forward = (ids, torch.cat([inputs["prompt_mask"], mask], 1), mask.size(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trainer_logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, *forward)
    return inputs, forward, trainer_logps


def _check_advantages_corrected(trainer, inputs, forward, trainer_logps):
    """The sampler's log-probs are those of the tokens it drew (the trainer's to bf16 rounding); the loss hook weighs
    the advantages by the truncated ratio and leaves the buffered batch as it was."""
    sampled, mask = inputs["sampling_per_token_logps"], inputs["completion_mask"]
    assert (sampled - trainer_logps).abs()[mask.bool()].max() < 0.02  # here 5e-4; one token off: 0.25
    before = inputs["advantages"].clone()
    corrected = trainer._with_sampler_correction(inputs)
    assert corrected is not inputs
    trainer._get_per_token_logps_and_entropies(trainer.model, *forward)
    weights, _ = sampler_correction(trainer_logps, sampled, mask, "token_truncate", None, 3.0)
    torch.testing.assert_close(corrected["advantages"], before.unsqueeze(1) * weights, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(inputs["advantages"], before, atol=0, rtol=0)


@pytest.mark.slow
def test_bf16_sampler_logprobs_are_the_sampled_tokens_and_weigh_the_advantages(tiny_model_path, tmp_path, units):
    units(True)
    trainer = _trainer(tiny_model_path, tmp_path, vllm_importance_sampling_mode="token_truncate")
    _check_advantages_corrected(trainer, *_generation_batch(trainer))


@pytest.mark.slow
def test_bf16_sampler_logprobs_are_kept_with_prefix_sharing_off(tiny_model_path, tmp_path, units, caplog):
    """TRL's own generation (no shared prefix) records the sampler's log-probs too: the same tokens as TRL's
    ``_generate_single_turn``, their log-probs the trainer's to bf16 rounding, and the loss corrected."""
    units(True)
    trainer = _trainer(
        tiny_model_path, tmp_path, share_prompt_prefix=False, vllm_importance_sampling_mode="token_truncate"
    )
    prompt_ids = [trainer.processing_class(f"What is {i} + 4?")["input_ids"] for i in (1, 1, 22, 333)]
    from trl_grpo_ext.cpu.precision import bf16_autocast

    with bf16_autocast(True):
        torch.manual_seed(0)
        theirs, none = trl.GRPOTrainer._generate_single_turn(trainer, prompt_ids, None, {}, 1)
        torch.manual_seed(0)
        ours, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert none is None and ours == theirs and [len(r) for r in logprobs] == [len(c) for c in ours]
    with caplog.at_level("WARNING"):
        _check_advantages_corrected(trainer, *_generation_batch(trainer))
    assert "without its token log-probs" not in caplog.text
    # a generation config whose rows are not one sample each gets no recorder (its log-probs would be misread)
    trainer.generation_config.num_beams = 2
    assert trainer._sampler_logprob_recorder() is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_vespo_takes_the_bf16_sampler_correction_inside_its_gamma_weights_as_trl_takes_vllms(
    tiny_model_path, tmp_path, units, mode
):
    units(True)
    trainer = _trainer(tiny_model_path, tmp_path, loss_type="vespo", vllm_importance_sampling_mode=mode)
    inputs, forward, _ = _generation_batch(trainer)
    sampled, mask = inputs["sampling_per_token_logps"], inputs["completion_mask"]
    corrected = trainer._with_sampler_correction(inputs)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, *forward)
    weights, _ = sampler_correction(logps, sampled, mask, mode, None, 3.0)
    torch.testing.assert_close(corrected["importance_sampling_ratio"], weights)
    assert torch.equal(corrected["advantages"], inputs["advantages"])  # not weighed twice
    assert "importance_sampling_ratio" not in inputs  # the buffered batch stays as generated
    # TRL's vespo loss reads it: its gamma weights get the correction as their importance_sampling_ratio
    seen = []
    gamma = trl.GRPOTrainer.get_gamma_weights

    def spy(**kwargs):
        seen.append(kwargs["importance_sampling_ratio"])
        return gamma(**kwargs)

    trainer.get_gamma_weights = spy
    assert torch.isfinite(trainer._compute_loss(trainer.model, inputs))
    assert len(seen) == 1 and torch.allclose(seen[0], weights, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_detection_off_keeps_the_fp32_path(tiny_model_path, tmp_path, units):
    """auto with no bf16 units: no autocast, no sampler log-probs, no correction; log-probs are TRL's own, bit for bit."""
    units(False)
    trainer = _trainer(tiny_model_path, tmp_path)
    assert trainer.args.bf16 is False and trainer.accelerator.mixed_precision == "no"
    assert trainer._sampler_logprob_recorder() is None
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": PROMPTS[i]} for i in range(2) for _ in range(4)])
    assert "sampling_per_token_logps" not in inputs
    assert trainer._with_sampler_correction(inputs) is inputs
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].size(1)
    trainer.args.share_prompt_prefix = False  # TRL's own forward through our hooks, against TRL's method itself
    ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, width)
    theirs, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, attn, width)
    assert torch.equal(ours, theirs)
    # the same completions as with bf16 forced off (the same seed draws the same tokens)
    forced = _trainer(tiny_model_path, tmp_path, bf16=False)
    forced.model.train()
    torch.manual_seed(0)
    again = forced._generate_and_score_completions([{"prompt": PROMPTS[i]} for i in range(2) for _ in range(4)])
    assert torch.equal(again["completion_ids"], inputs["completion_ids"])


@pytest.mark.slow
def test_eval_generator_samples_in_bf16_where_asked(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.evaluation import HFGenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    for bf16 in (False, True):
        seen.clear()
        with HFGenerator.borrowing(model, tokenizer, 3, bf16=bf16) as gen:
            gen.generate(["What is 3 + 4?", "What is 5 + 6?"], 1, greedy=True)
        assert set(seen) == {torch.bfloat16 if bf16 else torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_recipe_prints_and_records_the_precision_and_sampler(tiny_model_path, tmp_path, units, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    import yaml

    spec = importlib.util.spec_from_file_location(
        "gsm8k_grpo_precision", Path(__file__).parents[1] / "recipes" / "gsm8k_grpo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    units(False)
    monkeypatch.setenv("TRL_GRPO_EXT_SAMPLER_REASON", "generate: make train's default without vLLM")
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": tiny_model_path,
                "dataset_name": "synthetic",
                "synthetic_tasks": "chain_sum_easy:1",
                "reward_funcs": ["boxed"],
                "num_generations": 2,
                "per_device_train_batch_size": 2,
                "max_completion_length": 4,
                "max_steps": 1,
                "logging_steps": 1,
                "eval_num_samples": 0,
                "use_cpu": True,
                "bf16": "auto",
                "report_to": "none",
                "save_strategy": "no",
                "disable_tqdm": True,
                "output_dir": str(out),
            }
        )
    )
    assert module.main(["--config", str(recipe)]) == 0
    printed = capsys.readouterr().out
    assert "precision: fp32 (bf16: auto: TRL_GRPO_EXT_CPU_BF16=0 forces the detection off)" in printed
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["precision"] == {
        "bf16": False,
        "setting": "auto",
        "reason": f"{ENV_CPU_BF16}=0 forces the detection off",
    }
    reason = "make train's default without vLLM"
    assert f"sampler: transformers generate ({reason}; decode_engine: generate)" in printed
    assert summary["sampler"] == {"name": "generate", "reason": reason, "decode_engine": "generate"}
