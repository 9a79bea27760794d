"""Asynchronous sampling's shared rules and the TRL path's pieces without a model: the schedule, the staleness bound,
the per-step metrics, the copy-on-write weight hand-over and the sampler thread (slow, hung and dead samplers)."""

import logging
import threading
import time

import pytest
import torch

from trl_grpo_ext.cpu.token_draws import draw_tokens, fast_token_draws
from trl_grpo_ext.errors import ConfigError
from trl_grpo_ext.grpo.async_sampling import (
    AsyncStepStats,
    async_problems,
    busy_within,
    close_step,
    steps_to_request,
    too_stale,
)
from trl_grpo_ext.grpo.losses import ratio_by_staleness
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.trl.rollout_worker import AsyncSamplerError, RolloutRequest, RolloutWorker
from trl_grpo_ext.trl.weight_transfer import InProcessWeights, WeightTransferError


# ------------------------------------------------------------------ the schedule and the bound
def test_each_version_requests_the_steps_up_to_k_ahead_and_never_past_the_end():
    assert list(steps_to_request(0, 1, -1, 10)) == [0, 1]  # version 0 draws steps 0 and 1
    assert list(steps_to_request(1, 1, 1, 10)) == [2]  # then one step per version
    assert list(steps_to_request(0, 2, -1, 10)) == [0, 1, 2]
    assert list(steps_to_request(5, 2, 6, 10)) == [7]
    assert list(steps_to_request(9, 2, 9, 10)) == []  # nothing past max_steps
    assert list(steps_to_request(3, 0, 2, None)) == [3]  # K = 0: the step itself, on-policy
    # every step is requested once, by the version max(0, step - K)
    for k in (1, 2, 4):
        requested, by_version = -1, {}
        for version in range(12):
            for step in steps_to_request(version, k, requested, 12):
                by_version[step] = version
            requested = max(requested, *by_version)
        assert by_version == {step: max(0, step - k) for step in range(12)}


def test_a_batch_older_than_max_staleness_is_too_stale():
    assert not too_stale(3, 4, 1) and too_stale(3, 5, 1)
    assert not too_stale(0, 0, 0) and too_stale(0, 1, 0)


def test_step_stats_give_the_metrics_row():
    stats = AsyncStepStats(trainer_wait_s=1.0, weight_sync_s=0.2, sampler_busy_s=4.0, sampler_wait_s=3.0)
    stats.trained(batch_version=2, trainer_version=4, samples=3)
    stats.trained(batch_version=4, trainer_version=4, samples=1)
    stats.dropped = 8
    row = stats.metrics(step_wall_s=10.0)
    assert row["sample/staleness_mean"] == pytest.approx(1.5) and row["sample/staleness_max"] == 2.0
    assert row["sample/dropped_stale_total"] == 8.0
    assert row["perf/rollout_wait_s"] == 1.0 and row["rollout/weight_wait_s"] == 3.0
    assert row["perf/overlap_frac"] == pytest.approx((4.0 - 1.0) / 10.0)  # the trainer's wait overlaps nothing
    assert AsyncStepStats(sampler_busy_s=1.0, trainer_wait_s=3.0).metrics(2.0)["perf/overlap_frac"] == 0.0
    assert AsyncStepStats(sampler_busy_s=9.0).metrics(2.0)["perf/overlap_frac"] == 1.0


def test_busy_time_is_clipped_to_the_window():
    assert busy_within([(0.0, 2.0), (3.0, 5.0), (9.0, 10.0)], 1.0, 4.0) == pytest.approx(2.0)
    # a step's end keeps what is still running for the next step, forgets the rest
    assert close_step([(0.0, 2.0), (3.0, 5.0), (9.0, 10.0)], 1.0, 4.0) == (
        pytest.approx(2.0),
        [(3.0, 5.0), (9.0, 10.0)],
    )


def test_the_ratio_by_staleness_averages_each_stalenesss_tokens():
    log_ratio = torch.log(torch.tensor([[2.0, 4.0, 9.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    metrics = ratio_by_staleness(log_ratio, mask, torch.tensor([1, 0, 1]))
    assert metrics == pytest.approx({"sample/is_ratio/staleness_0": 1.0, "sample/is_ratio/staleness_1": 6.5 / 3})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_staleness", -1, "max_staleness=-1 must be an integer >= 0"),
        ("max_staleness", 1.5, "max_staleness=1.5 must be an integer >= 0"),
        ("max_staleness", True, "max_staleness=True must be an integer >= 0"),
        ("async_sampling", "yes", "async_sampling='yes' must be true or false"),
        ("async_timeout_s", 0, "async_timeout_s=0 must be a number of seconds > 0"),
    ],
)
def test_bad_async_settings_are_one_line_on_both_paths(field, value, message, tmp_path):
    from trl_grpo_ext.trl.config import GRPOConfig

    assert any(message in p for p in async_problems(type("C", (), {field: value})()))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        PyTrioGRPOConfig(output_dir=str(tmp_path), **{field: value})


# ------------------------------------------------------------------ the weight hand-over
def _params(*values):
    return [torch.full((3,), float(v)) for v in values]


def test_the_sampler_copies_the_published_version_and_the_trainer_never_copies_when_it_was_taken():
    trainer, sampler = _params(0, 0), _params(0, 0)  # the sampler starts as a copy of version 0
    weights = InProcessWeights(trainer, sampler, version=0)
    weights.expect(0)
    weights.acquire(0, 1.0)
    for p in trainer:
        p.fill_(1.0)  # the optimizer step of step 0
    weights.before_update()
    weights.publish(1)
    weights.expect(1)
    weights.acquire(1, 1.0)
    assert all(torch.equal(p, torch.ones(3)) for p in sampler)
    assert weights.staged_copies == 0


def test_a_version_still_wanted_is_copied_aside_before_the_optimizer_overwrites_it():
    trainer, sampler = _params(5, 6), _params(0, 0)
    weights = InProcessWeights(trainer, sampler, version=0)
    weights.publish(1)
    weights.expect(1)  # requested, but the sampler is busy with an older batch
    weights.before_update()  # the trainer is about to step: version 1 is copied aside
    for p in trainer:
        p.fill_(99.0)
    weights.publish(2)
    weights.acquire(1, 1.0)
    assert [float(p[0]) for p in sampler] == [5.0, 6.0]  # version 1, not the trainer's version 2
    assert weights.staged_copies == 1


def test_a_sampler_several_versions_behind_gets_each_version_it_owes():
    """At max_staleness 4 the sampler may still owe batches of versions 1 and 2 when the trainer reaches version 3:
    both are kept aside until taken (one slot for them deadlocked the K = 4 runs: version 1 was lost)."""
    trainer, sampler = _params(0), _params(0)
    weights = InProcessWeights(trainer, sampler, version=0)
    for version in (1, 2, 3):  # the trainer steps while the sampler is busy with version 0's batches
        weights.expect(version)
        weights.before_update()
        trainer[0].fill_(float(version))
        weights.publish(version)
    taken = []
    for version in (1, 2, 3):
        weights.acquire(version, 0.5)
        taken.append(float(sampler[0][0]))
    assert taken == [1.0, 2.0, 3.0]  # each batch drawn with the weights its request named
    assert weights.staged_copies == 2 and weights._staged == {}  # version 3 was live; nothing is held afterwards


def test_a_version_never_published_times_out_and_a_closed_transfer_stops_the_wait():
    weights = InProcessWeights(_params(0), _params(0), version=0)
    weights.expect(3)
    with pytest.raises(WeightTransferError, match="version 3 of the weights was not published within 0.2 s"):
        weights.acquire(3, 0.2)
    threading.Timer(0.1, weights.close).start()
    with pytest.raises(WeightTransferError, match="closed while the sampler waited for version 4"):
        weights.acquire(4, 10.0)


# ------------------------------------------------------------------ the sampler thread
def _request(seq, version=0, rows=2):
    return RolloutRequest(seq, seq, version, tuple((1, 2, seq) for _ in range(rows)), seed=seq)


def _echo(delay=0.0):
    def generate(request):
        time.sleep(delay)
        g = torch.Generator().manual_seed(request.seed)
        ids = [[int(torch.randint(0, 100, (1,), generator=g))] for _ in request.prompt_ids]
        return ids, [[-0.5] for _ in ids]

    return generate


def _drain(worker, n, trainer_delay=0.0):
    out = []
    for seq in range(n):
        time.sleep(trainer_delay)
        result, _ = worker.result(seq)
        out.append((result.request.seq, result.request.version, result.completion_ids))
    return out


def test_a_slow_sampler_or_a_slow_trainer_changes_the_waits_not_the_batches():
    runs = []
    for sampler_delay, trainer_delay in ((0.0, 0.0), (0.05, 0.0), (0.0, 0.05)):
        weights = InProcessWeights(_params(0), _params(0), version=0)
        worker = RolloutWorker(_echo(sampler_delay), weights, timeout_s=5.0)
        for seq in range(5):
            worker.submit(_request(seq))
        runs.append(_drain(worker, 5, trainer_delay))
        worker.close()
    assert runs[0] == runs[1] == runs[2]
    assert [seq for seq, _, _ in runs[0]] == list(range(5))


def test_a_sampler_that_dies_is_one_error_with_its_reason_in_the_trainer():
    def broken(request):
        if request.seq == 1:
            raise RuntimeError("out of memory in generate")
        return _echo()(request)

    worker = RolloutWorker(broken, InProcessWeights(_params(0), _params(0)), timeout_s=5.0)
    for seq in range(3):
        worker.submit(_request(seq))
    assert worker.result(0)[0].request.seq == 0
    with pytest.raises(AsyncSamplerError, match=r"the batch of step 2 .*RuntimeError: out of memory in generate"):
        worker.result(1)
    assert not worker.alive  # nothing more is drawn after a failure
    with pytest.raises(AsyncSamplerError, match="out of memory"):
        worker.submit(_request(3))


def test_a_hung_sampler_is_a_logged_stall_then_an_error_naming_the_batch(caplog):
    release = threading.Event()

    def hung(request):
        release.wait(5.0)
        return _echo()(request)

    worker = RolloutWorker(hung, InProcessWeights(_params(0), _params(0)), timeout_s=0.5)
    worker.submit(_request(0))
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext.trl.rollout_worker"):
        with pytest.raises(AsyncSamplerError, match=r"no batch from the sampler in 0.5 s .* the batch of step 1"):
            worker.result(0)
    assert any("stall" in record.getMessage() for record in caplog.records)
    release.set()
    worker.close()


def test_the_sampler_waits_for_its_version_and_a_version_never_published_fails_the_run():
    weights = InProcessWeights(_params(0), _params(0), version=0)
    worker = RolloutWorker(_echo(), weights, timeout_s=0.3)
    worker.submit(_request(0, version=1))  # version 1 does not exist yet
    deadline = time.monotonic() + 30
    while worker.alive and time.monotonic() < deadline:  # the sampler gives up after 0.3 s (the trainer would
        time.sleep(0.05)  # too, at the same time: this test is about the sampler's reason)
    with pytest.raises(AsyncSamplerError, match="version 1 of the weights was not published"):
        worker.result(0)


def test_a_request_drawn_with_its_own_generator_leaves_the_default_stream_alone():
    probs = torch.rand(4, 50)
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    with fast_token_draws(torch.Generator().manual_seed(3)):
        drawn = torch.multinomial(probs, 1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(drawn, draw_tokens(probs, torch.Generator().manual_seed(3)))
    with fast_token_draws():  # no generator: torch's default stream, as before
        torch.multinomial(probs, 1)
    assert not torch.equal(torch.random.get_rng_state(), before)


def test_a_failed_hand_over_to_a_server_stops_with_its_reason_and_each_version_goes_over_once():
    from trl_grpo_ext.trl.weight_transfer import ServerWeights

    synced = []
    weights = ServerWeights(lambda: synced.append(1))
    weights.publish(0)  # the server's own weights are unknown: the first version is handed over
    weights.publish(0)
    weights.publish(1)
    assert len(synced) == 2 and weights.acquire(1, 1.0) == (0.0, 0.0)
    with pytest.raises(WeightTransferError, match="needs version 0 of the weights but the sampling server holds 1"):
        weights.acquire(0, 1.0)

    def broken():
        raise ConnectionError("reload_weights: 500 Internal Server Error")

    with pytest.raises(WeightTransferError, match="handing version 2 of the weights to the sampling server failed: "
                       "ConnectionError: reload_weights: 500"):  # fmt: skip
        ServerWeights(broken).publish(2)


def test_an_urgent_request_is_drawn_before_the_requests_queued_ahead_of_it():
    """Dynamic sampling's extra round (urgent: the trainer waits for it) is drawn as soon as the sampler is free, not
    after the next steps' batches requested before it; with the current weights, while the version the queued
    batches still need is kept aside."""
    first_started, release = threading.Event(), threading.Event()
    order = []

    def generate(request):
        order.append(request.seq)
        if request.seq == 0:
            first_started.set()
            release.wait(5.0)
        return _echo()(request)

    trainer, sampler = _params(0), _params(0)
    weights = InProcessWeights(trainer, sampler, version=0)
    worker = RolloutWorker(generate, weights, timeout_s=5.0)
    worker.submit(_request(0))
    assert first_started.wait(5.0)
    worker.submit(_request(1, version=0))  # ahead: version 0
    worker.submit(_request(2, version=0))
    weights.before_update()  # the optimizer moves the trainer to version 1
    with torch.no_grad():
        for p in trainer:
            p.add_(1.0)
    weights.publish(1)
    worker.submit(RolloutRequest(3, None, 1, ((1, 2, 3),), seed=3, urgent=True))
    release.set()
    results = {seq: worker.result(seq)[0] for seq in (0, 3, 1, 2)}
    assert order == [0, 3, 1, 2]
    assert all(r.request.seq == seq for seq, r in results.items())
    # requests 1 and 2 were drawn with version 0 again after the urgent one loaded version 1
    assert torch.equal(sampler[0], trainer[0] - 1.0)
    worker.close()
