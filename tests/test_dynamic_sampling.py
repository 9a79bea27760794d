"""Dynamic sampling (DAPO's group filter): the shared decision, the batch merge and the TRL trainer on a tiny model."""

import math
import re
import zlib

import pytest
import torch
from datasets import Dataset

from trl_grpo_ext.grpo.dynamic_sampling import GroupFilter, GroupRef
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.sampling import merge_groups
from trl_grpo_ext.trl.trainer import GRPOTrainer

# --------------------------------------------------------------------------------------------- the decision


def test_filter_keeps_informative_groups_in_order_until_full():
    filt = GroupFilter(groups_needed=4, max_generation_batches=5)
    filt.add([True, False, True, True])
    assert not filt.done and filt.informative_kept == 1
    filt.add([False, False, True, False])
    assert filt.done and filt.full
    assert filt.selection() == [GroupRef(0, 1), GroupRef(1, 0), GroupRef(1, 1), GroupRef(1, 3)]
    assert filt.metrics() == {
        "generation_batches": 2.0,
        "frac_degenerate_before_filter": 4 / 8,
        "frac_degenerate": 0.0,
    }
    with pytest.raises(RuntimeError):
        filt.add([False] * 4)


def test_filter_budget_pads_with_degenerate_groups():
    filt = GroupFilter(groups_needed=3, max_generation_batches=2)
    filt.add([True, True, False])
    assert not filt.done
    filt.add([True, True, True])
    assert filt.done and not filt.full
    assert filt.selection() == [GroupRef(0, 2), GroupRef(0, 0, padding=True), GroupRef(0, 1, padding=True)]
    metrics = filt.metrics()
    assert metrics["generation_batches"] == 2.0
    assert metrics["frac_degenerate_before_filter"] == pytest.approx(5 / 6)
    assert metrics["frac_degenerate"] == pytest.approx(2 / 3)


def test_filter_one_batch_budget_is_plain_grpo():
    filt = GroupFilter(groups_needed=2, max_generation_batches=1)
    filt.add([True, False])
    assert filt.done
    assert filt.selection() == [GroupRef(0, 1), GroupRef(0, 0, padding=True)]
    assert filt.metrics()["frac_degenerate"] == filt.metrics()["frac_degenerate_before_filter"] == 0.5


def test_filter_partitions_fill_from_their_own_groups_and_decide_together():
    # two processes, two groups each: process 1 is full after batch 0, process 0 only after batch 1
    filt = GroupFilter(groups_needed=4, max_generation_batches=3, num_partitions=2)
    filt.add([True, False, False, False])
    assert not filt.done  # every process keeps generating until all are full
    filt.add([False, True, True, True])
    assert filt.done
    assert filt.selection(0) == [GroupRef(0, 1), GroupRef(1, 0)]
    assert filt.selection(1) == [GroupRef(0, 0), GroupRef(0, 1)]  # its own first two, batch 1's are surplus
    assert filt.metrics()["frac_degenerate"] == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(groups_needed=0, max_generation_batches=1),
        dict(groups_needed=3, max_generation_batches=0),
        dict(groups_needed=3, max_generation_batches=1, num_partitions=2),
    ],
)
def test_filter_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        GroupFilter(**kwargs)


def test_filter_rejects_wrong_batch_size():
    with pytest.raises(ValueError, match="groups"):
        GroupFilter(groups_needed=2, max_generation_batches=2).add([True])


# --------------------------------------------------------------------------------------------- merging batches


def _batch(prompt_width, completion_width, n_rows, offset):
    ids = torch.arange(n_rows * prompt_width).reshape(n_rows, prompt_width) + offset
    comp = torch.arange(n_rows * completion_width).reshape(n_rows, completion_width) + offset + 1000
    return {
        "prompt_ids": ids,
        "prompt_mask": torch.ones_like(ids),
        "completion_ids": comp,
        "completion_mask": torch.ones_like(comp),
        "old_per_token_logps": torch.full((n_rows, completion_width), -1.0),
        "advantages": torch.arange(n_rows, dtype=torch.float32) + offset,
        "num_items_in_batch": torch.tensor(n_rows * completion_width),
    }


def test_merge_repads_prompts_left_completions_right_and_masks_padding():
    a, b = _batch(3, 2, 4, 0), _batch(5, 4, 4, 100)  # two groups of 2 per batch, different widths
    merged = merge_groups([a, b], [GroupRef(1, 1), GroupRef(0, 0, padding=True)], 2, pad_token_id=-7)
    assert merged["prompt_ids"].shape == (4, 5) and merged["completion_ids"].shape == (4, 4)
    assert torch.equal(merged["prompt_ids"][:2], b["prompt_ids"][2:])
    assert (
        torch.equal(merged["prompt_ids"][2:, 2:], a["prompt_ids"][:2]) and (merged["prompt_ids"][2:, :2] == -7).all()
    )
    assert (merged["prompt_mask"][2:, :2] == 0).all() and (merged["prompt_mask"][2:, 2:] == 1).all()
    assert torch.equal(merged["completion_ids"][2:, :2], a["completion_ids"][:2])
    assert (merged["completion_ids"][2:, 2:] == -7).all()
    assert (merged["old_per_token_logps"][2:, 2:] == 0).all()
    assert torch.equal(merged["completion_mask"][:2], torch.ones(2, 4, dtype=torch.long))
    assert (merged["completion_mask"][2:] == 0).all()  # the padding group trains on nothing
    assert merged["advantages"].tolist() == [102.0, 103.0, 0.0, 0.0]
    assert "num_items_in_batch" not in merged


def test_merge_refuses_fields_it_cannot_pad():
    a = _batch(2, 2, 2, 0)
    a["pixel_values"] = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="pixel_values"):
        merge_groups([a], [GroupRef(0, 0)], 2, 0)


# --------------------------------------------------------------------------------------------- the trainer

N_PROMPTS = 16
COMMON = dict(
    report_to="none",
    use_cpu=True,
    bf16=False,
    num_generations=4,
    max_completion_length=6,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
    learning_rate=1e-2,
    dynamic_sampling=True,
)


def flat_or_varied(completions, flat, **kwargs):
    """Prompts marked `flat` score 0.5 whatever the completion (a degenerate group); the others a hash of the
    completion text, which differs between sampled completions."""
    out = []
    for completion, is_flat in zip(completions, flat, strict=True):
        text = completion[0]["content"]
        out.append(0.5 if is_flat else (zlib.crc32(text.encode()) % 997) / 997)
    return out


def make_dataset(flat_ids):
    prompts = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(N_PROMPTS)]
    return Dataset.from_dict({"prompt": prompts, "flat": [i in flat_ids for i in range(N_PROMPTS)]})


class RecordingTrainer(GRPOTrainer):
    """Records each generation batch's degenerate flags and the rows every loss call trains on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated = []  # (optimizer step, degenerate flags)
        self.trained = []  # (optimizer step, prompt index of each row with a completion token, all rows)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.generated.append((self.state.global_step, self.mixin_state.degenerate_groups.tolist()))
        return output

    def _compute_loss(self, model, inputs):
        texts = self.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
        ids = [int(re.findall(r"What is (\d+) \+ 4", t)[-1]) for t in texts]
        active = inputs["completion_mask"].sum(1) > 0
        self.trained.append(
            (self.state.global_step, [i for i, a in zip(ids, active.tolist(), strict=True) if a], len(ids))
        )
        return super()._compute_loss(model, inputs)


def train(path, tmp_path, flat_ids, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kwargs})
    trainer = RecordingTrainer(path, [flat_or_varied], args=args, train_dataset=make_dataset(flat_ids))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, logs


def batches_per_step(trainer):
    steps = {}
    for step, flags in trainer.generated:
        steps.setdefault(step, []).append(flags)
    return [steps[s] for s in sorted(steps)]


@pytest.mark.slow
def test_degenerate_groups_are_replaced_until_the_step_is_full(tiny_model_path, tmp_path):
    flat = set(range(0, N_PROMPTS, 2))  # half the prompts always give a degenerate group
    trainer, logs = train(
        tiny_model_path, tmp_path, flat, per_device_train_batch_size=8, max_steps=3, max_generation_batches=6
    )
    steps = batches_per_step(trainer)
    assert len(steps) == len(logs) == 3
    for batches, entry in zip(steps, logs, strict=True):
        informative = sum(not d for flags in batches for d in flags)
        seen = sum(len(flags) for flags in batches)
        assert informative >= 2  # the step filled up
        assert entry["generation_batches"] == len(batches)
        assert entry["frac_degenerate_before_filter"] == pytest.approx((seen - informative) / seen)
        assert entry["frac_degenerate"] == 0.0
        assert math.isfinite(entry["loss"]) and entry["train_tokens"] > 0
    assert any(len(b) > 1 for b in steps), "no step needed a second generation batch; the test shows nothing"
    # every row trained on comes from an informative prompt, and each step trains on a full batch of 8 rows
    for _step, active, total in trainer.trained:
        assert total == 8 and len(active) == 8
        assert not set(active) & flat


@pytest.mark.slow
def test_budget_reached_trains_on_what_there_is(tiny_model_path, tmp_path):
    flat = set(range(N_PROMPTS)) - {3}  # one informative prompt in sixteen
    trainer, logs = train(
        tiny_model_path, tmp_path, flat, per_device_train_batch_size=8, max_steps=2, max_generation_batches=2
    )
    steps = batches_per_step(trainer)
    for batches, entry, (_s, active, total) in zip(steps, logs, trainer.trained, strict=True):
        informative = sum(not d for flags in batches for d in flags)
        assert entry["generation_batches"] == (len(batches))
        assert len(batches) == 2 or informative >= 2
        kept = min(informative, 2)
        assert entry["frac_degenerate"] == pytest.approx(1 - kept / 2)
        assert total == 8 and len(active) == 4 * kept and set(active) <= {3}
        if kept == 0:
            assert entry["train_tokens"] == 0
    assert any(entry["frac_degenerate"] > 0 for entry in logs), "the budget never ran out; the test shows nothing"


@pytest.mark.slow
def test_all_degenerate_budget_moves_no_weight(tiny_model_path, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        **{**COMMON, "per_device_train_batch_size": 8, "max_steps": 1},
        max_generation_batches=2,
    )
    trainer = RecordingTrainer(tiny_model_path, [flat_or_varied], args=args, train_dataset=make_dataset(range(99)))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    (entry,) = [h for h in trainer.state.log_history if "loss" in h]
    assert entry["generation_batches"] == 2 and entry["frac_degenerate"] == 1.0
    assert entry["frac_degenerate_before_filter"] == 1.0 and entry["train_tokens"] == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_gradient_accumulation_and_two_iterations(tiny_model_path, tmp_path):
    # 2 micro-batches of 4 rows per optimizer step, each generation reused for 2 optimizer steps
    flat = set(range(0, N_PROMPTS, 2))
    trainer, logs = train(
        tiny_model_path,
        tmp_path,
        flat,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=4,
        max_generation_batches=6,
    )
    assert len(logs) == 4
    generated_steps = sorted({step for step, _ in trainer.generated})
    assert generated_steps == [0, 2]  # a new generation every num_iterations optimizer steps
    with_generation = [entry for entry in logs if "generation_batches" in entry]
    assert len(with_generation) == 2 and all(entry["frac_degenerate"] == 0.0 for entry in with_generation)
    assert [t for _s, _a, t in trainer.trained] == [4] * 8
    assert all(not set(active) & flat and len(active) == 4 for _s, active, _t in trainer.trained)
    # the reused generation's rows: the same 8 prompts trained in iterations 1 and 2, ratios moved off 1
    first = sorted(i for s, a, _t in trainer.trained if s == 0 for i in a)
    second = sorted(i for s, a, _t in trainer.trained if s == 1 for i in a)
    assert first == second
    assert any(abs(entry["ratio_mean"] - 1.0) > 1e-7 for entry in logs)


def test_config_checks_dynamic_sampling_fields(tmp_path):
    with pytest.raises(ValueError, match="max_generation_batches"):
        GRPOConfig(output_dir=str(tmp_path), max_generation_batches=0, use_cpu=True)
    with pytest.raises(ValueError, match="max_generation_batches"):
        GRPOConfig(output_dir=str(tmp_path), max_generation_batches=True, use_cpu=True)


@pytest.mark.slow
def test_two_processes_take_the_same_decision(tiny_model_path, tmp_path):
    """accelerate launch --num_processes 2 (gloo): both ranks generate the same number of batches per step (else
    the collectives would hang), each trains only on informative groups it generated, none is padding."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           str(root / "tests" / "multiprocess_dynamic_sampling.py"), "--model", tiny_model_path,
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=300, cwd=root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["generated"] == ranks[1]["generated"]  # same decision on both processes
    logs = ranks[0]["log_history"]
    assert len(logs) == 3
    for step, entry in enumerate(logs):
        assert entry["generation_batches"] == ranks[0]["generated"].count(step)
        assert entry["frac_degenerate"] == 0.0 and entry["frac_degenerate_before_filter"] > 0.0
    assert any(entry["generation_batches"] > 1 for entry in logs)
    for rank in ranks:
        assert len(rank["trained"]) == 3
        for pids in rank["trained"]:
            assert len(pids) == 4 and all(p % 2 == 1 for p in pids)


# --------------------------------------------------------------------------------------------- the PyTRIO loop

PYTRIO_REWARD = "e2_flat_or_varied"


def _pytrio_flat_or_varied(completions, flat, **kwargs):
    from trl_grpo_ext.task.answers import completion_text

    return [
        0.5 if f else (zlib.crc32(completion_text(c).encode()) % 997) / 997
        for c, f in zip(completions, flat, strict=True)
    ]


@pytest.fixture
def pytrio_reward():
    from trl_grpo_ext.task.rewards import REWARD_REGISTRY, register_reward

    register_reward(PYTRIO_REWARD)(_pytrio_flat_or_varied)
    yield PYTRIO_REWARD
    REWARD_REGISTRY.pop(PYTRIO_REWARD, None)  # other modules iterate over the registry


class _Reply:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


class FakeSampler:
    """pytrio sampling client stand-in: completions are a function of the request's seed."""

    def __init__(self, vocab):
        self.vocab, self.requests = vocab, 0

    def sample(self, model_input, num_samples, sampling_params, return_text=False):
        import random as rnd
        from types import SimpleNamespace

        self.requests += 1
        rng = rnd.Random(sampling_params.seed)
        seqs = []
        for _ in range(num_samples):
            tokens = [rng.randrange(3, self.vocab) for _ in range(rng.randint(1, 5))]
            seqs.append(SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens), stop_reason="stop"))
        return _Reply(SimpleNamespace(sequences=seqs))


class FakeTrainingClient:
    def __init__(self, vocab):
        self.sampler = FakeSampler(vocab)

    def save_weights_and_get_sampling_client(self):
        return self.sampler


def _pytrio_loop(tiny_model_path, flat_ids, **kw):
    from transformers import AutoTokenizer

    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.pytrio.loop import GRPOLoop

    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 4?"}], "answer": f"#### {i + 4}", "flat": i in flat_ids,
         "pid": i, "task": "even" if i % 2 == 0 else "odd"}
        for i in range(N_PROMPTS)
    ]  # fmt: skip
    base = dict(num_generations=4, per_device_train_batch_size=8, reward_funcs=[PYTRIO_REWARD], dynamic_sampling=True)
    config = PyTrioGRPOConfig(**{**base, **kw})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    loop = GRPOLoop(config, rows=rows, tokenizer=tokenizer)
    client = FakeTrainingClient(len(tokenizer))
    return loop, client, loop.prepare(client)


def test_pytrio_step_samples_until_its_groups_are_informative(tiny_model_path, pytrio_reward):
    from trl_grpo_ext.pytrio.types import StepTimes

    flat = set(range(0, N_PROMPTS, 2))
    loop, client, stream = _pytrio_loop(tiny_model_path, flat, max_generation_batches=8)
    for step in range(3):
        before, extra_before = stream.position, loop.extra_stream.position
        scored, metrics = loop.sample_and_score(client, stream, step, StepTimes())
        rounds = int(metrics["generation_batches"])
        # two prompts a round: the step's own from the stream, the extra rounds' from a stream of their own
        assert stream.position - before == 2
        assert loop.extra_stream.position - extra_before == 2 * (rounds - 1)
        assert metrics["frac_degenerate"] == 0.0 and 0.0 <= metrics["frac_degenerate_before_filter"] < 1.0
        assert len(scored.rows) == 2 and not any(row["flat"] for row in scored.rows)
        assert len(scored.rollouts) == len(scored.advantages) == scored.rewards.shape[0] == 8
        assert scored.degenerate == [False, False]
        for key in (
            "reward",
            "reward_std",
            f"rewards/{_pytrio_flat_or_varied.__name__}/mean",
            "completions/mean_length",
        ):
            assert key in metrics
    assert client.sampler.requests > 6, "no step needed a second round; the test shows nothing"


def test_pytrio_asynchronous_steps_take_their_prompts_in_order_and_count_each_rounds_staleness(
    tiny_model_path, pytrio_reward
):
    """Drawn one step ahead, each step's first round has the prompts on-policy would give it (the stream read step
    by step); its extra rounds, drawn by the step's own weights, are staleness 0 and come from their own stream."""
    from trl_grpo_ext.pytrio.lookahead import SampleAhead
    from trl_grpo_ext.pytrio.types import StepTimes

    flat = set(range(0, N_PROMPTS, 2))
    on_policy, client, stream = _pytrio_loop(tiny_model_path, flat, max_generation_batches=8)
    expected = [on_policy.sample_and_score(client, stream, step, StepTimes())[0] for step in range(3)]
    loop, client, stream = _pytrio_loop(
        tiny_model_path, flat, max_generation_batches=8, async_sampling=True, max_staleness=1
    )
    loop.ahead = SampleAhead(loop.config, loop.prompts)
    extra_rounds, seen = 0, set()
    for step in range(3):
        scored, metrics = loop.sample_and_score(client, stream, step, StepTimes())
        assert [r["pid"] for r in scored.rows] == [r["pid"] for r in expected[step].rows]
        row = loop.ahead.step_metrics(0.0, 0.0)
        extra_rounds += int(metrics["generation_batches"]) - 1
        first = 0 if step == 0 else 1  # drawn a step ahead, by the weights one step older
        # the kept groups' staleness: the first round's `first`, the extra rounds' 0 (drawn by the step's weights)
        stale = scored.staleness or [0] * len(scored.rollouts)
        assert set(stale) <= {0, first} and row["sample/staleness_mean"] == pytest.approx(sum(stale) / len(stale))
        seen.update(stale)
    assert extra_rounds > 0, "no step needed a second round; the test shows nothing"
    assert seen == {0, 1}, "no step trained groups of both the batch drawn ahead and an extra round"


def test_pytrio_budget_trains_on_what_there_is(tiny_model_path, pytrio_reward):
    from trl_grpo_ext.pytrio.batch import build_train_batch
    from trl_grpo_ext.pytrio.types import StepTimes

    loop, client, stream = _pytrio_loop(tiny_model_path, set(range(N_PROMPTS)), max_generation_batches=2)
    scored, metrics = loop.sample_and_score(client, stream, 0, StepTimes())
    assert metrics["generation_batches"] == 2 and metrics["frac_degenerate"] == 1.0
    assert metrics["frac_degenerate_before_filter"] == 1.0
    # nothing informative: the padding stays, with zero advantages, so the step runs and moves nothing
    assert len(scored.rows) == 2 and all(a == 0.0 for a in scored.advantages)
    assert build_train_batch(loop.config, scored, 0).train_tokens == 0

    loop, client, stream = _pytrio_loop(tiny_model_path, set(range(N_PROMPTS)) - {5}, max_generation_batches=3)
    found = False
    for step in range(6):
        scored, metrics = loop.sample_and_score(client, stream, step, StepTimes())
        kept = round(2 * (1 - metrics["frac_degenerate"]))
        if 0 < kept < 2:  # fewer groups than a full step: the padding is left out
            found = True
            assert [row["pid"] for row in scored.rows] == [5] * kept and len(scored.rollouts) == 4 * kept
    assert found, "no step ended with part of its groups; the test shows nothing"


def test_pytrio_without_dynamic_sampling_is_one_round(tiny_model_path, pytrio_reward):
    from trl_grpo_ext.pytrio.types import StepTimes

    loop, client, stream = _pytrio_loop(tiny_model_path, set(range(0, N_PROMPTS, 2)), dynamic_sampling=False)
    scored, metrics = loop.sample_and_score(client, stream, 0, StepTimes())
    assert "generation_batches" not in metrics and stream.position == 2 and client.sampler.requests == 2
    assert len(scored.rows) == 2


def test_pytrio_curriculum_updates_from_each_round(tiny_model_path, pytrio_reward):
    from trl_grpo_ext.grpo.curriculum import CurriculumPromptStream
    from trl_grpo_ext.pytrio.types import StepTimes

    # even prompts: always 0.5 (never pass at threshold 1.0); odd: a hash below 1 (never pass either) -> p falls
    loop, client, stream = _pytrio_loop(tiny_model_path, set(range(0, N_PROMPTS, 2)), curriculum=True)
    assert isinstance(stream, CurriculumPromptStream)
    _, metrics = loop.sample_and_score(client, stream, 0, StepTimes())
    assert loop.curriculum.updates == metrics["generation_batches"]
    assert metrics["curriculum/even/pass_rate"] < 0.5 and "curriculum/odd/weight" in metrics


@pytest.mark.slow
def test_pytrio_run_on_local_server_logs_both_options(tiny_model_path, tmp_path, pytrio_reward):
    """train_step end to end (local pytrio server, tiny model): dynamic sampling and the curriculum together."""
    import dataclasses

    from stopping_loop import StoppingLoop

    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.pytrio.loop import GRPOLoop
    from trl_grpo_ext.pytrio_server import running_server
    from trl_grpo_ext.runs import run_metrics
    from trl_grpo_ext.runs.loop_state import load_loop_state

    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 4?"}], "answer": f"#### {i + 4}", "flat": i % 2 == 0,
         "task": "even" if i % 2 == 0 else "odd"}
        for i in range(N_PROMPTS)
    ]  # fmt: skip
    config = PyTrioGRPOConfig(
        base_model=tiny_model_path, lora_r=4, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=6, max_steps=2, save_every=1, reward_funcs=[PYTRIO_REWARD], learning_rate=5e-3,
        output_dir=str(tmp_path / "run"), seed=3, dynamic_sampling=True, max_generation_batches=4, curriculum=True,
    )  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    with running_server(tiny_model_path, api_key="trio-local-e2-test-key", ephemeral_storage=True) as server:
        server.configure_client(home=str(home))
        StoppingLoop(config, rows=rows, stop_after=1).run()  # step 1, checkpoint, stop (as a kill would)
        saved = load_loop_state(config.output_dir).curriculum
        resumed = GRPOLoop(dataclasses.replace(config, resume=True), rows=rows)
        resumed.run()
    logged = run_metrics(config.output_dir)
    # the loop state carried the pass rates: the resumed curriculum counts step 1's rounds, then step 2's
    assert saved["updates"] == logged[0]["generation_batches"]
    assert resumed.curriculum.updates == logged[0]["generation_batches"] + logged[1]["generation_batches"]
    assert [r["step"] for r in logged] == [1, 2]
    for row in logged:
        for key in ("generation_batches", "frac_degenerate_before_filter", "frac_degenerate", "loss", "train_tokens",
                    "curriculum/even/weight", "curriculum/odd/pass_rate", "num_datums"):  # fmt: skip
            assert key in row, key
        full = row["frac_degenerate"] == 0.0
        assert row["num_datums"] <= 8 and (not full or row["train_tokens"] > 0)
