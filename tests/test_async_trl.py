"""Asynchronous GRPO on the TRL path (`trl_grpo_ext.trl.async_sampling`), trained for real on the tiny model: the
staleness schedule, the loss's old log-probs, determinism whatever the speed of either side, max_staleness 0 as the
synchronous path, resume with nothing lost or drawn twice, and the failures (a sampler that dies or hangs)."""

import copy
import json
import math
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


def test_batches_are_drawn_sample_ahead_steps_ahead_and_max_staleness_only_bounds_it(tiny_model_path, tmp_path):
    for k, ahead, expected in ((1, 1, [0, 1, 1, 1]), (2, 1, [0, 1, 1, 1]), (2, 2, [0, 1, 2, 2])):
        _, rows = _train(tiny_model_path, tmp_path, f"k{k}n{ahead}", max_staleness=k, sample_ahead=ahead)
        assert [row["sample/staleness_max"] for row in rows] == expected
        assert [row["sample/staleness_mean"] for row in rows] == expected
        assert all(row["sample/dropped_stale_total"] == 0 for row in rows)
        # decoupled: the loss's ratio is against the weights of the step's start (1 with one step per batch); the
        # behaviour ratio proximal/sampler is 1 where the sampler had the trained weights, not after
        assert all(row["ratio_mean"] == pytest.approx(1.0, abs=1e-6) for row in rows)
        assert rows[0]["sample/is_ratio/staleness_0"] == pytest.approx(1.0, abs=1e-4)
        assert rows[-1][f"sample/is_ratio/staleness_{ahead}"] != pytest.approx(1.0, abs=1e-6)
        assert rows[-1]["sampling/sampler_kl"] > 1e-6
        for key in ("perf/rollout_wait_s", "rollout/weight_wait_s", "perf/overlap_frac", "sampling/sampler_kl"):
            assert all(key in row for row in rows[1:]), key


def test_the_coupled_objective_takes_the_losss_ratio_against_the_sampler(tiny_model_path, tmp_path):
    _, rows = _train(tiny_model_path, tmp_path, "coupled", async_objective="coupled")
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert rows[-1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)


def test_the_decoupled_behaviour_weight_follows_trls_importance_sampling_settings(tiny_model_path, tmp_path):
    """token_mask with a band no stale ratio fits: every token of a stale batch is masked (loss 0, no gradient),
    where the same run with the correction off trains."""
    masked = dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.9999999,
                  vllm_importance_sampling_clip_max=1.0000001, max_steps=3)  # fmt: skip
    _, rows = _train(tiny_model_path, tmp_path, "masked", **masked)
    assert rows[0]["sampling/is_ratio_truncated_frac"] < 0.5  # staleness 0: the ratios are 1 to rounding
    assert rows[-1]["sampling/is_ratio_truncated_frac"] > 0.9
    assert rows[-1]["grad_norm"] == pytest.approx(0.0, abs=1e-4)
    _, off = _train(tiny_model_path, tmp_path, "off", vllm_importance_sampling_correction=False, **masked)
    assert off[-1]["grad_norm"] > 1e-3


def test_at_staleness_0_every_ratio_is_1_at_any_sampling_setting(tiny_model_path, tmp_path):
    """temperature 0.7 with top_p 0.9 (and with top_k 5): the sampler's log-probs are those of the distribution it
    drew from, the trainer's of the same distribution of its logits, so at step 1 (the sampler holds the trained
    weights) the mismatch is rounding only; a later step's is the staleness."""
    for name, settings in (("top_p", dict(top_p=0.9)), ("top_k", dict(top_k=5, min_p=0.05))):
        _, rows = _train(tiny_model_path, tmp_path, name, temperature=0.7, max_steps=2, **settings)
        first = rows[0]
        assert first["sample/staleness_max"] == 0
        assert first["sampling/sampler_kl"] <= 1e-5
        assert 0.999 <= first["sampling/is_ratio_raw/min"] <= first["sampling/is_ratio_raw/max"] <= 1.001
        assert rows[1]["sampling/sampler_kl"] > 1e-5


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
    """sample_ahead 3 with a sampler slower than the trainer: when it reaches step 4's batch (version 1) the trainer
    is already at version 3, so versions 1 and 2 must have been kept aside; the run trains what a run with a fast
    sampler trains."""
    settings = dict(max_staleness=3, sample_ahead=3, max_steps=6, async_timeout_s=30)
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
    saving = dict(save_strategy="steps", save_steps=2, max_staleness=2, sample_ahead=2)
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
    saving = dict(save_strategy="steps", save_steps=2, max_staleness=2, sample_ahead=2)
    _train(tiny_model_path, tmp_path, "k2", **saving)
    checkpoint = tmp_path / "k2" / "checkpoint-2"
    # both saved batches are 2 steps older than the steps they are for: too old for max_staleness 1
    resume = {**saving, "max_staleness": 1, "sample_ahead": 1}
    _, resumed = _train(tiny_model_path, tmp_path, "k1", resume=str(checkpoint), **resume)
    assert [row["sample/dropped_stale_total"] for row in resumed] == [8, 8]  # one generation batch each
    assert [row["sample/staleness_max"] for row in resumed] == [0, 0]  # drawn again with the current weights


def test_an_unreadable_saved_batch_file_is_one_line_before_training(tiny_model_path, tmp_path):
    saving = dict(save_strategy="steps", save_steps=2, max_steps=2)
    _train(tiny_model_path, tmp_path, "run", **saving)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / ASYNC_ROLLOUTS_FILENAME).write_text('{"format": 2, "batches": [{"step": "x"}]}')
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


def test_a_batch_trained_over_several_steps_is_logged_at_each_steps_staleness(tiny_model_path, tmp_path):
    """num_iterations 2 (and steps_per_generation twice the accumulation steps): each generation batch trains two
    optimizer steps, one step staler at the second; the proximal policy is TRL's generation-time forward, so the
    loss's ratio moves off 1 at the second step while the behaviour ratio corrects the lag."""
    for name, settings in (
        ("iterations", dict(num_iterations=2)),
        ("spg", dict(steps_per_generation=4, per_device_train_batch_size=2)),
    ):
        _, rows = _train(tiny_model_path, tmp_path, name, max_staleness=2, max_steps=4, **settings)
        assert [row["sample/staleness_max"] for row in rows] == [0, 1, 1, 2], name
        assert rows[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # the second step of the first batch
        assert "sample/is_ratio/staleness_2" in rows[3]


def test_a_bound_that_a_batch_trained_over_several_steps_would_pass_is_refused(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"max_staleness=1: each generation batch trains 2 optimizer steps.*>= 2"):
        _config(tmp_path, "refused", num_iterations=2)
    with pytest.raises(ValueError, match="sample_ahead=2 exceeds max_staleness=1"):
        _config(tmp_path, "refused", sample_ahead=2)
    with pytest.raises(ValueError, match="repetition_penalty=1.1 with async_sampling"):
        _config(tmp_path, "refused", repetition_penalty=1.1)
    for kwargs in ({"typical_p": 0.9}, {"no_repeat_ngram_size": 3}, {"temperature": 0.5}):
        with pytest.raises(ValueError, match=rf"generation_kwargs \['{next(iter(kwargs))}'\] with async_sampling"):
            _config(tmp_path, "refused", generation_kwargs=kwargs)
    assert _config(tmp_path, "accepted", generation_kwargs={"use_cache": True}).async_sampling
    with pytest.raises(ValueError, match="async_objective='both' must be one of decoupled, coupled"):
        _config(tmp_path, "refused", async_objective="both")


def test_a_run_resumed_inside_a_batchs_window_draws_the_rest_again(tiny_model_path, tmp_path):
    """num_iterations 2, checkpoint after step 1 (inside the first batch's two steps): the resumed run draws that
    window's batch again with the current weights, as TRL's on-policy resume does, and every later step trains
    within the bound."""
    saving = dict(num_iterations=2, max_staleness=2, save_strategy="steps", save_steps=1, max_steps=4)
    _train(tiny_model_path, tmp_path, "whole", **saving)
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    _, resumed = _train(tiny_model_path, tmp_path, "resumed", resume=str(checkpoint), **saving)
    assert [row["step"] for row in resumed] == [2, 3, 4]
    assert all(0 <= row["sample/staleness_max"] <= 2 for row in resumed)
    assert all(math.isfinite(row["loss"]) for row in resumed)


def _nan_logprobs(generate):
    """A sampler whose log-probs are NaN for every third token (vLLM can return NaN)."""

    def drawn(request):
        ids, logps = generate(request)
        return ids, [[float("nan") if i % 3 == 0 else x for i, x in enumerate(row)] for row in logps]

    return drawn


def _null_logprobs(generate):
    """NaN as vLLM's server sends it in JSON: null (None)."""

    def drawn(request):
        ids, logps = generate(request)
        return ids, [[None if i % 3 == 0 else x for i, x in enumerate(row)] for row in logps]

    return drawn


@pytest.mark.parametrize("wrap", [_nan_logprobs, _null_logprobs], ids=["nan", "null"])
def test_nan_sampler_log_probs_count_as_no_difference(tiny_model_path, tmp_path, monkeypatch, wrap):
    """Also in a checkpoint's saved batches (NaN as null) and a run resumed from them."""
    _wrap_sampler(monkeypatch, wrap)
    saving = dict(save_strategy="steps", save_steps=2, max_steps=3)
    for objective in ("decoupled", "coupled"):
        _, rows = _train(tiny_model_path, tmp_path, objective, async_objective=objective, **saving)
        for row in rows:
            assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), (objective, row)
            assert math.isfinite(row["sampling/sampler_kl"])
        checkpoint = tmp_path / objective / "checkpoint-2"
        saved = json.loads((checkpoint / ASYNC_ROLLOUTS_FILENAME).read_text())
        assert None in saved["batches"][0]["completions"][0]["logprobs"]
        _, resumed = _train(tiny_model_path, tmp_path, f"{objective}-resumed", resume=str(checkpoint),
                            async_objective=objective, **saving)  # fmt: skip
        assert [row["step"] for row in resumed] == [3] and math.isfinite(resumed[0]["loss"])


def test_an_evaluation_on_vllms_server_hands_the_weights_over_between_the_samplers_batches(
    tiny_model_path, tmp_path, monkeypatch
):
    """With TRL's vLLM server as the sampler, an evaluation during training generates on the same server: the
    weights it needs go over only once the sampler's batch in flight is drawn (not under it, labelled with the older
    version), through the hand-over, and TRL's own sync is not run again."""
    import threading

    import trl as trl_module

    from trl_grpo_ext.trl.rollout_worker import RolloutRequest, RolloutWorker
    from trl_grpo_ext.trl.weight_transfer import ServerWeights

    trainer = _trainer(tiny_model_path, tmp_path, "server")
    drawing, started = threading.Event(), threading.Event()
    synced_while_drawing = []

    def generate(request):  # the server drawing a batch of the trainer's look-ahead
        drawing.set()
        started.set()
        time.sleep(0.5)
        drawing.clear()
        return [[1]] * len(request.prompt_ids), [[-0.5]] * len(request.prompt_ids)

    def sync():
        synced_while_drawing.append(drawing.is_set())

    def trl_generate(self, prompts):  # TRL's vLLM generation: syncs when vLLM holds another step's weights
        if self._last_loaded_step != self.state.global_step:
            sync()
            self._last_loaded_step = self.state.global_step
        return ("generated", [], None, [], 0, None, {})  # TRL's output layout, empty

    monkeypatch.setattr(trl_module.GRPOTrainer, "_generate", trl_generate)
    trainer.use_vllm, trainer._last_loaded_step = True, 0
    trainer._worker = RolloutWorker(generate, ServerWeights(sync, version=0), 5.0)
    trainer._worker.submit(RolloutRequest(0, 1, 0, ((1, 2),), seed=0))
    assert started.wait(5.0)
    trainer.state.global_step = 1  # the optimizer stepped while the server draws step 2's batch with version 0
    trainer.model.eval()
    try:
        assert trainer._generate([[{"role": "user", "content": "1 + 1?"}]])[0] == "generated"
    finally:
        trainer._worker.close()
    assert synced_while_drawing == [False]  # once, after the batch in flight was drawn


def test_with_lora_the_sampler_draws_with_its_own_copy_of_the_weights(tiny_model_path, tmp_path, monkeypatch):
    """TRL's fused head is patched onto PEFT's inner model and closes over the trainer's: the sampler's copy must not
    call it (it would draw with the trainer's live weights, whatever version it was asked for)."""
    from types import SimpleNamespace

    from peft import LoraConfig

    copies = []

    def deepcopy(model):
        copies.append(copy.deepcopy(model))
        return copies[-1]

    monkeypatch.setattr(async_sampling, "copy", SimpleNamespace(deepcopy=deepcopy))
    trainer = GRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=_config(tmp_path, "lora"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    )
    worker = trainer._start_sampler()
    try:
        ids = torch.tensor([[1, 5, 9, 12]])
        with torch.no_grad():
            before = copies[0](input_ids=ids).logits
            for name, p in trainer.model.named_parameters():
                if "lora" in name:
                    p.add_(0.5)
            after = copies[0](input_ids=ids).logits
            trained = trainer.model(input_ids=ids).logits
    finally:
        worker.close()
        trainer._stop_sampler()
    assert torch.equal(before, after) and not torch.allclose(after, trained)
