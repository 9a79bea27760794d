"""The look-ahead both paths share (`trl_grpo_ext.grpo.lookahead`): batches by step, the drop-and-redraw of one too
old for the bound, the one saved-batch schema (NaN log-probs included), its typing when read back, busy time."""

import math

import pytest

from trl_grpo_ext.grpo.lookahead import Completion, Lookahead, restored


class FakeSampler:
    """A `BatchSampler` drawing one completion per prompt at once; records what it was sent."""

    def __init__(self):
        self.sent = []

    def submit(self, batch, now=False):
        self.sent.append((batch.step, batch.slot, batch.version, now))
        return batch

    def collect(self, batch):
        return [Completion(p, (batch.version, batch.seed), (-0.5, float("nan"))) for p in batch.prompt_ids]


PROMPTS = ((1, 2), (1, 2), (3, 4), (3, 4))


def test_a_batch_too_old_for_the_bound_is_dropped_counted_and_drawn_again_now():
    sampler = FakeSampler()
    ahead = Lookahead(sampler, max_staleness=1)
    ahead.request(step=3, slot=0, version=1, seed=7, prompt_ids=PROMPTS)
    batch = ahead.take(3, version=3)  # two steps old under a bound of one
    assert batch.version == 3 and [c.completion_ids for c in batch.completions] == [(3, 7)] * 4
    assert sampler.sent == [(3, 0, 1, False), (3, 0, 3, True)]
    assert ahead.step_metrics(0.0, now=1.0)["sample/dropped_stale_total"] == 4
    with pytest.raises(KeyError, match="no batch was requested for step 5"):
        ahead.take(4, version=4)


def test_saved_batches_read_back_as_they_were_and_are_kept_for_the_same_prompts_only():
    sampler = FakeSampler()
    ahead = Lookahead(sampler, max_staleness=2)
    ahead.request(2, 0, 0, 5, PROMPTS, rows=[{"answer": "3"}, {"answer": "7"}])
    ahead.request(3, 1, 1, 6, PROMPTS)
    saved = ahead.saved()
    assert saved[0]["completions"][0]["logprobs"] == [-0.5, None]  # NaN as JSON's null
    again = Lookahead(FakeSampler(), max_staleness=2, saved=saved)
    assert again.request(2, 0, 1, 5, PROMPTS) is again.batches[(2, 0)]  # kept: not sent again
    assert again.sampler.sent == []
    batch = again.take(2, version=2)
    assert batch.version == 0 and batch.rows == [{"answer": "3"}, {"answer": "7"}]
    assert math.isnan(batch.completions[0].logprobs[1])
    again.request(3, 1, 2, 6, ((9, 9),) * 4)  # other prompts: drawn again
    assert again.sampler.sent == [(3, 1, 2, False)]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.update(step="x"), "step must be an integer"),
        (lambda b: b.update(rows="x"), "rows must be a list of mappings"),
        (lambda b: b["completions"][0].update(logprobs=[1.0]), "one log-prob per token"),
        (lambda b: b["completions"][0].update(completion_ids=[1.5, 2]), "token ids must be integers"),
        (lambda b: b.pop("version"), "malformed saved batch"),
    ],
)
def test_a_malformed_saved_batch_is_one_line(change, message):
    ahead = Lookahead(FakeSampler(), max_staleness=1)
    ahead.request(1, 0, 0, 5, PROMPTS, rows=[{}])
    data = ahead.saved()[0]
    change(data)
    with pytest.raises(ValueError, match=message):
        restored(data)


def test_the_samplers_busy_time_is_counted_within_the_step():
    ahead = Lookahead(FakeSampler(), max_staleness=1)
    ahead.record_busy(0.5, 1.5)
    ahead.record_busy(1.8, 3.0)  # runs past the step's end: its rest belongs to the next step
    metrics = ahead.step_metrics(1.0, weight_sync_s=0.1, now=2.0)
    assert metrics["perf/overlap_frac"] == pytest.approx(0.7)
    assert metrics["rollout/weight_wait_s"] == pytest.approx(1.0 - 0.7 - 0.1)
    assert ahead.step_metrics(2.0, now=3.0)["perf/overlap_frac"] == pytest.approx(1.0)


def test_a_batch_of_a_step_gone_by_is_let_go():
    sampler = FakeSampler()
    ahead = Lookahead(sampler, max_staleness=2)
    ahead.request(2, 0, 1, 5, PROMPTS)
    ahead.request(3, 0, 1, 6, PROMPTS)
    ahead.discard_before(3)
    assert list(ahead.batches) == [(3, 0)]
