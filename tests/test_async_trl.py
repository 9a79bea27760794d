"""Asynchronous GRPO on the TRL path (`trl_grpo_ext.trl.async_sampling`), trained for real on the tiny model: the
staleness schedule, the loss's old log-probs, determinism whatever the speed of either side, max_staleness 0 as the
synchronous path, resume with nothing lost or drawn twice, and the failures (a sampler that dies or hangs)."""

import json
import time

import pytest
import torch
from datasets import Dataset

from trl_grpo_ext.runs import ASYNC_ROLLOUTS_FILENAME
from trl_grpo_ext.trl import async_sampling, rollout_worker
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.rollout_worker import AsyncSamplerError
from trl_grpo_ext.trl.trainer import GRPOTrainer

pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(32)]
# the per-step numbers two runs must share to have trained the same batches the same way
TRAINED = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "ratio_mean", "entropy")


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def _config(tmp_path, name, **overrides):
    settings = dict(
        output_dir=str(tmp_path / name),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=5e-3,  # large enough that one step moves the policy: stale ratios are not 1
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_steps=4,
        loss_type="cispo",
        async_sampling=True,
        max_staleness=1,
    )
    return GRPOConfig(**{**settings, **overrides})


def _train(path, tmp_path, name, resume=None, **overrides):
    trainer = _trainer(path, tmp_path, name, **overrides)
    first = trainer.state.global_step
    trainer.train(resume_from_checkpoint=resume)
    start = int(str(resume).rsplit("-", 1)[1]) if resume else first  # a resumed run's history holds the earlier rows
    return trainer, [row for row in trainer.state.log_history if "loss" in row and row["step"] > start]


def _wrap_sampler(monkeypatch, wrap):
    """Every sampler thread built from now on draws through ``wrap(generate)`` (a slow, dying or hung sampler)."""
    original = rollout_worker.RolloutWorker.__init__

    def init(self, generate, *args, **kwargs):
        original(self, wrap(generate), *args, **kwargs)

    monkeypatch.setattr(rollout_worker.RolloutWorker, "__init__", init)


def _trainer(path, tmp_path, name, rewards=(length_reward,), tools=None, **overrides):
    return GRPOTrainer(
        path,
        list(rewards),
        args=_config(tmp_path, name, **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        tools=tools,
    )


def _trained(rows):
    return [{key: row[key] for key in TRAINED} for row in rows]


def test_batches_are_drawn_k_steps_ahead_and_trained_against_the_samplers_log_probs(tiny_model_path, tmp_path):
    for k, expected in ((1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])):
        _, rows = _train(tiny_model_path, tmp_path, f"k{k}", max_staleness=k)
        assert [row["sample/staleness_max"] for row in rows] == expected
        assert [row["sample/staleness_mean"] for row in rows] == expected
        assert all(row["sample/dropped_stale_total"] == 0 for row in rows)
        # the loss's ratio is against the sampler: exactly 1 where the sampler had the trained weights, not after
        assert rows[0]["sample/is_ratio/staleness_0"] == pytest.approx(1.0, abs=1e-4)
        assert rows[-1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
        assert f"sample/is_ratio/staleness_{k}" in rows[-1]
        for key in ("perf/rollout_wait_s", "rollout/weight_wait_s", "perf/overlap_frac", "sampling/sampler_kl"):
            assert all(key in row for row in rows[1:]), key


def _late(seconds):
    """A sampler that takes `seconds` longer for each batch (a wrap for `_wrap_sampler`)."""

    def wrap(generate):
        def drawn(request):
            time.sleep(seconds)
            return generate(request)

        return drawn

    return wrap


def test_a_slow_sampler_or_a_slow_trainer_trains_the_same_batches_the_same_way(tiny_model_path, tmp_path, monkeypatch):
    _, baseline = _train(tiny_model_path, tmp_path, "base")

    with monkeypatch.context() as patch:
        _wrap_sampler(patch, _late(0.3))
        _, slow_sampled = _train(tiny_model_path, tmp_path, "slow-sampler")
    assert sum(row["perf/rollout_wait_s"] for row in slow_sampled[1:]) > 0.3  # the trainer did wait

    step_end = async_sampling._AsyncSamplingCallback.on_step_end

    def slow_trainer(self, *args, **kwargs):
        time.sleep(0.3)
        return step_end(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(async_sampling._AsyncSamplingCallback, "on_step_end", slow_trainer)
        _, slow_trained = _train(tiny_model_path, tmp_path, "slow-trainer")
    assert _trained(slow_sampled) == _trained(baseline) == _trained(slow_trained)


def test_a_sampler_several_versions_behind_draws_each_batch_with_the_version_it_was_requested_with(
    tiny_model_path, tmp_path, monkeypatch
):
    """max_staleness 3 with a sampler slower than the trainer: when it reaches step 4's batch (version 1) the trainer
    is already at version 3, so versions 1 and 2 must have been kept aside; the run trains what a run with a fast
    sampler trains."""
    settings = dict(max_staleness=3, max_steps=6, async_timeout_s=30)
    _, fast = _train(tiny_model_path, tmp_path, "fast", **settings)
    with monkeypatch.context() as patch:
        _wrap_sampler(patch, _late(1.0))
        _, slow = _train(tiny_model_path, tmp_path, "slow", **settings)
    assert [row["sample/staleness_max"] for row in slow] == [0, 1, 2, 3, 3, 3]
    assert _trained(slow) == _trained(fast)


def test_max_staleness_0_is_the_synchronous_path(tiny_model_path, tmp_path):
    torch.manual_seed(0)
    _, sync = _train(tiny_model_path, tmp_path, "sync", async_sampling=False, max_steps=2)
    torch.manual_seed(0)
    trainer, k0 = _train(tiny_model_path, tmp_path, "k0", max_staleness=0, max_steps=2)
    assert not trainer.async_active
    assert [{k: v for k, v in r.items() if k != "step_time"} for r in k0] == [
        {k: v for k, v in r.items() if k != "step_time"} for r in sync
    ]


def test_a_resumed_run_trains_the_batches_an_uninterrupted_one_would(tiny_model_path, tmp_path):
    saving = dict(save_strategy="steps", save_steps=2, max_staleness=2)
    _, whole = _train(tiny_model_path, tmp_path, "whole", **saving)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    saved = json.loads((checkpoint / ASYNC_ROLLOUTS_FILENAME).read_text())
    # after two steps the batches of the next two were drawn already: by version 0 (requested with steps 1-2) and 1
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(2, 0), (3, 1)]
    _, resumed = _train(tiny_model_path, tmp_path, "resumed", resume=str(checkpoint), **saving)
    assert _trained(resumed) == _trained(whole[2:])
    assert [row["sample/staleness_max"] for row in resumed] == [2, 2]
    assert [row["sample/dropped_stale_total"] for row in resumed] == [0, 0]


def test_a_saved_batch_older_than_the_resumed_bound_is_dropped_counted_and_drawn_again(tiny_model_path, tmp_path):
    saving = dict(save_strategy="steps", save_steps=2, max_staleness=2)
    _train(tiny_model_path, tmp_path, "k2", **saving)
    checkpoint = tmp_path / "k2" / "checkpoint-2"
    # both saved batches are 2 steps older than the steps they are for: too old for max_staleness 1
    _, resumed = _train(tiny_model_path, tmp_path, "k1", resume=str(checkpoint), **{**saving, "max_staleness": 1})
    assert [row["sample/dropped_stale_total"] for row in resumed] == [8, 8]  # one generation batch each
    assert [row["sample/staleness_max"] for row in resumed] == [0, 0]  # drawn again with the current weights


def test_an_unreadable_saved_batch_file_is_one_line_before_training(tiny_model_path, tmp_path):
    saving = dict(save_strategy="steps", save_steps=2, max_steps=2)
    _train(tiny_model_path, tmp_path, "run", **saving)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / ASYNC_ROLLOUTS_FILENAME).write_text('{"format": 1, "batches": [{"step": "x"}]}')
    with pytest.raises(ValueError, match="unreadable asynchronous batches"):
        _train(tiny_model_path, tmp_path, "again", resume=str(checkpoint), **{**saving, "max_steps": 4})


def test_a_sampler_that_dies_stops_the_run_with_its_reason(tiny_model_path, tmp_path, monkeypatch):
    def dying(generate):
        def drawn(request):
            if request.step == 2:
                raise RuntimeError("sampler crashed")
            return generate(request)

        return drawn

    _wrap_sampler(monkeypatch, dying)
    trainer = _trainer(tiny_model_path, tmp_path, "dies")
    with pytest.raises(AsyncSamplerError, match=r"the batch of step 3 .*RuntimeError: sampler crashed"):
        trainer.train()
    assert trainer._worker is None  # stopped: no thread outlives the run
    assert trainer.state.global_step == 2  # nothing was trained from the failed draw


def test_a_hung_sampler_stops_the_run_after_async_timeout_s(tiny_model_path, tmp_path, monkeypatch):
    def hanging(generate):
        def drawn(request):
            if request.step == 1:
                time.sleep(30)
            return generate(request)

        return drawn

    _wrap_sampler(monkeypatch, hanging)
    trainer = _trainer(tiny_model_path, tmp_path, "hangs", async_timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(AsyncSamplerError, match=r"no batch from the sampler in 2 s .*the batch of step 2"):
        trainer.train()
    assert time.monotonic() - start < 25


def test_what_async_sampling_cannot_run_with_is_refused_in_one_line(tiny_model_path, tmp_path):
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression
        """
        return expression

    with pytest.raises(ValueError, match="async_sampling does not sample multi-turn tool calls"):
        _trainer(tiny_model_path, tmp_path, "tools", tools=[calculator])


def half_flat_reward(completions, prompts, **kwargs):
    """Flat (degenerate) for prompts with an even number, the length otherwise."""
    numbers = [int(p[0]["content"].split()[2]) for p in prompts]
    return [1.0 if n % 2 == 0 else float(len(c[0]["content"])) for n, c in zip(numbers, completions, strict=True)]


def test_dynamic_samplings_extra_batches_are_drawn_on_demand_with_the_current_weights(tiny_model_path, tmp_path):
    options = dict(dynamic_sampling=True, max_generation_batches=3, max_steps=3)
    trainer = _trainer(tiny_model_path, tmp_path, "dynamic", rewards=(half_flat_reward,), **options)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert any(row["generation_batches"] > 1 for row in rows)
    for row in rows[1:]:
        # the scheduled batch is 1 step old, each extra one drawn by the step's own weights (staleness 0)
        assert row["sample/staleness_max"] == 1
        extra = row["generation_batches"] - 1
        assert row["sample/staleness_mean"] == pytest.approx(1 / (1 + extra))


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_that_resumes(tiny_model_path, tmp_path):
    """The recipe, asynchronous, Ctrl-C'd after step 2 (tests/kill_points.py sends SIGINT there): it stops with a
    checkpoint holding the batches drawn ahead, skips the eval after training, and the resumed run ends the job with
    every step logged once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kill_points import SCRIPT as KILL_POINTS
    from kill_points import TEST_KILL_ENV

    from trl_grpo_ext.runs import METRICS_FILENAME, read_metrics_file

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    recipe = [
        str(root / "recipes" / "gsm8k_grpo.py"), "--model_name_or_path", tiny_model_path, "--output_dir", str(out),
        "--max_steps", "4", "--logging_steps", "1", "--max_completion_length", "8", "--per_device_train_batch_size",
        "4", "--num_generations", "2", "--eval_num_samples", "4", "--synthetic_tasks", "chain_sum", "--report_to",
        "none", "--async_sampling", "true", "--max_staleness", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TEST_KILL_ENV}
    first = subprocess.run(
        [sys.executable, str(KILL_POINTS), *recipe], env={**env, TEST_KILL_ENV: "interrupt:2"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-3000:]
    assert "Ctrl-C: stopping after this step with a checkpoint" in log
    assert "[eval after] skipped" in log
    assert (out / "checkpoint-2" / ASYNC_ROLLOUTS_FILENAME).is_file()
    assert [r["step"] for r in read_metrics_file(out / METRICS_FILENAME)[0]] == [1, 2]
    second = subprocess.run(
        [sys.executable, *recipe, "--resume_from_checkpoint", "true"], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in second.stdout
    assert [r["step"] for r in read_metrics_file(out / METRICS_FILENAME)[0]] == [1, 2, 3, 4]


def test_a_colocated_vllm_engine_is_refused_before_trl_loads_it(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="async_sampling samples with vLLM's server"):
        _trainer(tiny_model_path, tmp_path, "colocate", use_vllm=True, vllm_mode="colocate")
