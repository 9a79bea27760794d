"""Asynchronous GRPO on the PyTRIO path (`trl_grpo_ext.pytrio.lookahead`) against the local server on the tiny model:
the same schedule and metrics as the TRL path, the same batches whatever the speed of either side, a resumed run
that trains what an uninterrupted one would, and max_staleness 0 as the synchronous loop."""

import json

import pytest
from test_pytrio_loop import ROWS, local_pytrio, loop_config, pytrio_client  # noqa: F401 - fixtures

from trl_grpo_ext.pytrio import lookahead
from trl_grpo_ext.pytrio.loop import GRPOLoop
from trl_grpo_ext.runs import run_metrics
from trl_grpo_ext.runs.loop_state import load_loop_state

# every test here talks to the module's local server (test_pytrio_loop's fixtures)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pytrio_client")]

# the per-step numbers two runs must share to have sampled and trained the same way: the tokens exactly; the
# numbers computed from log-probs to float rounding (a request's log-probs follow its decode batch-mates to ~5e-7
# on the local server, docs/pytrio_server.md; its tokens do not). The decoupled objective weighs each completion by
# exp of its summed log-prob differences, and the loss sums terms of either sign: its rounding is its terms' (~1e-5)
SAMPLED = ("reward", "reward_std", "completions/mean_length", "train_tokens")
COMPUTED = ("loss", "ratio_mean", "grad_norm")


def _run(tmp_path, name, loop_cls=GRPOLoop, **kw):
    settings = dict(max_steps=4, save_every=0, mode="async", loss_type="cispo", async_sampling=True, max_staleness=1)
    config = loop_config(tmp_path / name, **{**settings, **kw})
    loop_cls(config, rows=ROWS).run()
    return run_metrics(config.output_dir), config


def _same(rows, expected):
    """Whether two runs sampled and trained the same way, step by step."""
    assert [{key: r[key] for key in SAMPLED} for r in rows] == [{key: r[key] for key in SAMPLED} for r in expected]
    for r, e in zip(rows, expected, strict=True):
        for key in COMPUTED:
            assert r[key] == pytest.approx(e[key], rel=1e-4, abs=1e-5 if key == "loss" else 1e-6), (key, r["step"])
    return True


def test_the_next_steps_are_drawn_sample_ahead_behind_and_max_staleness_only_bounds_it(tiny_model_path, tmp_path):
    for k, ahead, expected in ((1, 1, [0, 1, 1, 1]), (2, 1, [0, 1, 1, 1]), (2, 2, [0, 1, 2, 2])):
        rows, config = _run(tmp_path, f"k{k}n{ahead}", base_model=tiny_model_path, max_staleness=k, sample_ahead=ahead)
        assert [r["sample/staleness_max"] for r in rows] == expected
        assert all(r["sample/dropped_stale_total"] == 0 for r in rows)
        for key in ("perf/rollout_wait_s", "rollout/weight_wait_s", "perf/overlap_frac", "sampling/sampler_kl"):
            assert all(key in r for r in rows), key
        # decoupled: the loss's ratio is against the step's own weights (1), the behaviour ratio against the
        # sampler's: 1 at staleness 0, off 1 once the batch is a step old
        assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) for r in rows)
        assert rows[0]["sample/is_ratio/staleness_0"] == pytest.approx(1.0, abs=2e-3)
        assert abs(rows[-1][f"sample/is_ratio/staleness_{ahead}"] - 1.0) > 1e-4
        # the same prompts as on-policy, in the same order: the stream is read step by step
        assert load_loop_state(config.output_dir).data_position == 4 * config.prompts_per_step


def test_the_coupled_objective_takes_the_losss_ratio_against_the_sampler(tiny_model_path, tmp_path):
    rows, _ = _run(tmp_path, "coupled", base_model=tiny_model_path, async_objective="coupled")
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
    assert abs(rows[-1]["ratio_mean"] - 1.0) > 1e-4
    assert "sample/is_ratio/staleness_1" in rows[-1]  # logged whatever the objective, as on the TRL path


def test_several_steps_behind_each_batch_is_drawn_by_the_weights_of_its_request(tiny_model_path, tmp_path):
    """sample_ahead 3: the first four batches are drawn by version 0's sampler, then one by each later version while
    the sampler still owes older ones (the server loads a request's weights when it queues it)."""
    rows, _ = _run(tmp_path, "k3", base_model=tiny_model_path, max_staleness=3, sample_ahead=3, max_steps=6)
    assert [r["sample/staleness_max"] for r in rows] == [0, 1, 2, 3, 3, 3]
    assert all(r["sample/dropped_stale_total"] == 0 for r in rows)


def test_a_slow_sampler_changes_the_waits_not_the_batches(tiny_model_path, tmp_path, monkeypatch):
    baseline, _ = _run(tmp_path, "base", base_model=tiny_model_path)
    collect = lookahead.collect_samples

    def slow_collect(*args, **kwargs):
        import time

        time.sleep(0.5)
        return collect(*args, **kwargs)

    monkeypatch.setattr(lookahead, "collect_samples", slow_collect)
    slow, _ = _run(tmp_path, "slow", base_model=tiny_model_path)
    assert _same(slow, baseline)
    assert sum(r["perf/rollout_wait_s"] for r in slow) > sum(r["perf/rollout_wait_s"] for r in baseline)


def test_max_staleness_0_is_the_synchronous_loop(tiny_model_path, tmp_path):
    sync, _ = _run(tmp_path, "sync", base_model=tiny_model_path, async_sampling=False, max_steps=2)
    k0, _ = _run(tmp_path, "k0", base_model=tiny_model_path, max_staleness=0, max_steps=2)
    assert _same(k0, sync)
    assert not any(key.startswith("sample/staleness") for key in k0[0])


def test_a_resumed_run_trains_the_batches_drawn_before_the_stop(tiny_model_path, tmp_path):
    from stopping_loop import StoppingLoop

    k2 = dict(save_every=2, max_staleness=2, sample_ahead=2)
    whole, _ = _run(tmp_path, "whole", base_model=tiny_model_path, **k2)
    _run(tmp_path, "stopped", loop_cls=lambda c, rows: StoppingLoop(c, rows=rows, stop_after=3),
         base_model=tiny_model_path, **k2)  # fmt: skip
    state = load_loop_state(tmp_path / "stopped" / "run")
    assert state.step == 2 and [(b["step"], b["version"]) for b in state.ahead] == [(2, 0), (3, 1)]
    resumed, _ = _run(tmp_path, "stopped", base_model=tiny_model_path, resume=True, **k2)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _same(resumed, whole)


def test_a_kept_batch_too_old_for_the_resumed_bound_is_dropped_and_drawn_again(tiny_model_path, tmp_path):
    from stopping_loop import StoppingLoop

    _run(tmp_path, "run", loop_cls=lambda c, rows: StoppingLoop(c, rows=rows, stop_after=2),
         base_model=tiny_model_path, save_every=2, max_staleness=2, sample_ahead=2)  # fmt: skip
    resumed, _ = _run(tmp_path, "run", base_model=tiny_model_path, save_every=2, max_staleness=1, resume=True)
    # steps 3 and 4 kept batches drawn 2 steps before: too old for max_staleness 1, each drawn again on-policy
    assert [r["sample/dropped_stale_total"] for r in resumed[2:]] == [8, 8]
    assert [r["sample/staleness_max"] for r in resumed[2:]] == [0, 0]


def test_a_malformed_kept_batch_is_one_line(tiny_model_path, tmp_path):
    from stopping_loop import StoppingLoop

    _run(tmp_path, "run", loop_cls=lambda c, rows: StoppingLoop(c, rows=rows, stop_after=2),
         base_model=tiny_model_path, save_every=2, max_staleness=2)  # fmt: skip
    path = tmp_path / "run" / "run" / "pytrio_state.json"
    state = json.loads(path.read_text())
    state["ahead"][0]["completions"][0]["logprobs"] = []
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="a batch drawn ahead in the loop state is malformed"):
        _run(tmp_path, "run", base_model=tiny_model_path, save_every=2, max_staleness=2, resume=True)


def test_tools_with_async_sampling_are_refused(tmp_path):
    from trl_grpo_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="async_sampling does not sample multi-turn tool calls"):
        loop_config(tmp_path, environments=["calculator"], async_sampling=True)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_that_resumes(tiny_model_path, tmp_path):
    """SIGINT during step 2 of an asynchronous run: step 2 ends, a checkpoint holds it and the batches drawn ahead,
    the run stops; `resume: true` ends the job with every step logged once."""
    import os
    import signal

    class InterruptedLoop(GRPOLoop):
        def train_step(self, training_client, stream, step):
            if step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 2 trains
            return super().train_step(training_client, stream, step)

    # as in a terminal: Python's own handler (a background job, as a CI runner may be, starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rows, config = _run(
            tmp_path, "run", loop_cls=InterruptedLoop, base_model=tiny_model_path, max_staleness=2, sample_ahead=2
        )
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was given back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [r["step"] for r in rows] == [1, 2]
    state = load_loop_state(config.output_dir)
    assert state.step == 2 and [b["step"] for b in state.ahead] == [2, 3]
    resumed, _ = _run(tmp_path, "run", base_model=tiny_model_path, max_staleness=2, sample_ahead=2, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]


def test_an_on_policy_resume_of_an_asynchronous_checkpoint_draws_its_kept_prompts_again(tiny_model_path, tmp_path):
    """Resumed without async_sampling, the batches the checkpoint kept are too old for on-policy: their prompts are
    drawn again with the current weights (no prompt skipped, none twice), so every step trains on-policy."""
    from stopping_loop import StoppingLoop

    _run(tmp_path, "run", loop_cls=lambda c, rows: StoppingLoop(c, rows=rows, stop_after=2),
         base_model=tiny_model_path, save_every=2, max_staleness=1)  # fmt: skip
    kept = load_loop_state(tmp_path / "run" / "run").ahead
    assert [(b["step"], b["version"]) for b in kept] == [(2, 1)]  # one step old: within max_staleness 1, not 0
    resumed, config = _run(
        tmp_path, "run", base_model=tiny_model_path, save_every=2, async_sampling=False, resume=True
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=2e-3) for r in resumed[2:])  # on-policy again
    assert load_loop_state(config.output_dir).data_position == 4 * config.prompts_per_step  # nothing skipped


def test_at_staleness_0_every_ratio_is_1_at_temperature_0_7_with_top_p(tiny_model_path, tmp_path):
    """The service's forward_backward scores the untempered policy (the protocol): at temperature 0.7 with top_p 0.9
    the loop takes the sampler's weights' own log-probs of each completion (compute_logprobs) as the behaviour
    policy, so at step 1 (the sampler holds the trained weights) the mismatch is rounding only."""
    rows, _ = _run(tmp_path, "t07", base_model=tiny_model_path, temperature=0.7, top_p=0.9, max_steps=2)
    first = rows[0]
    assert first["sample/staleness_max"] == 0
    assert first["sampling/sampler_kl"] <= 1e-5
    assert 0.999 <= first["sampling/is_ratio_raw/min"] <= first["sampling/is_ratio_raw/max"] <= 1.001
    assert rows[1]["sampling/sampler_kl"] > 1e-6
