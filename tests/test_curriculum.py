"""Adaptive curriculum: weights from synthetic pass rates, the samplers that follow them, the TRL trainer hook."""

import math
import zlib
from collections import Counter

import pytest
from datasets import Dataset

from trl_grpo_ext.grpo.curriculum import (
    Curriculum,
    CurriculumPromptStream,
    curriculum_from_tasks,
    passed_values,
)
from trl_grpo_ext.trl.config import GRPOConfig
from trl_grpo_ext.trl.sampling import CurriculumSampler


def batch(rates: dict[str, float], n: int = 20):
    """One generation batch: ``n`` completions per task, the first ``rate * n`` of them passing."""
    tasks, passed = [], []
    for task, rate in rates.items():
        k = round(rate * n)
        tasks += [task] * n
        passed += [1.0] * k + [0.0] * (n - k)
    return tasks, passed


def test_first_update_follows_the_formula():
    cur = Curriculum({"a": 2.0, "b": 1.0, "c": 1.0}, ema=0.3, floor=0.05, prior=0.5)
    assert cur.weights() == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})  # every p = prior: the base mix
    cur.update(*batch({"a": 1.0, "b": 0.0}))  # c not in this batch: its estimate stays
    assert cur.pass_rates == pytest.approx({"a": 0.65, "b": 0.35, "c": 0.5})
    raw = {"a": 0.5 * (0.65 * 0.35 + 0.05), "b": 0.25 * (0.35 * 0.65 + 0.05), "c": 0.25 * (0.25 + 0.05)}
    total = sum(raw.values())
    assert cur.weights() == pytest.approx({t: w / total for t, w in raw.items()})
    metrics = cur.metrics()
    assert metrics["curriculum/a/pass_rate"] == pytest.approx(0.65)
    assert metrics["curriculum/c/weight"] == pytest.approx(raw["c"] / total)


def test_always_and_never_solved_tasks_lose_weight():
    cur = Curriculum({"always": 1.0, "never": 1.0, "half": 1.0})
    for _ in range(15):
        cur.update(*batch({"always": 1.0, "never": 0.0, "half": 0.5}))
    w = cur.weights()
    assert cur.pass_rates["always"] > 0.99 and cur.pass_rates["never"] < 0.01
    assert w["half"] > 0.7 and w["always"] < 0.15 and w["never"] < 0.15
    # the floor keeps them in the mix: weight ~ floor / (0.25 + 3 * floor) when p(1-p) ~ 0
    assert w["always"] == pytest.approx(0.05 / (0.25 + 0.05 + 2 * 0.05), rel=0.1)
    assert sum(w.values()) == pytest.approx(1.0)


def test_deterministic_and_order_independent():
    updates = [batch({"x": 0.2, "y": 0.9}), batch({"x": 0.6, "y": 0.4}), batch({"x": 0.0, "y": 1.0})]
    a, b = Curriculum({"x": 1, "y": 3}), Curriculum({"x": 1, "y": 3})
    for tasks, passed in updates:
        a.update(tasks, passed)
        b.update(list(reversed(tasks)), list(reversed(passed)))  # same batch, completions listed in another order
    assert a.weights() == b.weights() and a.pass_rates == b.pass_rates


def test_unscored_completions_are_ignored_and_bad_input_refused():
    cur = Curriculum({"x": 1.0})
    cur.update(["x", "x", "x"], [1.0, math.nan, None])
    assert cur.pass_rates["x"] == pytest.approx(0.7 * 0.5 + 0.3 * 1.0)
    with pytest.raises(ValueError, match="not in the curriculum"):
        cur.update(["zzz"], [1.0])
    with pytest.raises(ValueError, match="pass values"):
        cur.update(["x"], [])
    for kwargs in (dict(ema=0.0), dict(ema=1.5), dict(floor=0.0), dict(prior=2.0)):
        with pytest.raises(ValueError):
            Curriculum({"x": 1.0}, **kwargs)
    with pytest.raises(ValueError):
        Curriculum({"x": 0.0})


def test_passed_values_and_base_weights_from_rows():
    assert passed_values([1.3, 0.3, 1.0, math.nan], 1.0)[:3] == [1.0, 0.0, 1.0]
    assert math.isnan(passed_values([math.nan], 1.0)[0])
    cur = curriculum_from_tasks(["a", "b", "a", "a"])
    assert cur.tasks == ["a", "b"] and cur.base == {"a": 0.75, "b": 0.25}
    with pytest.raises(ValueError, match="task name"):
        curriculum_from_tasks(["a", None])


def test_state_round_trip():
    a = Curriculum({"x": 1.0, "y": 1.0})
    a.update(*batch({"x": 1.0, "y": 0.25}))
    b = Curriculum({"x": 1.0, "y": 1.0})
    b.load_state_dict(a.state_dict())
    assert b.weights() == a.weights() and b.updates == 1
    with pytest.raises(ValueError):
        Curriculum({"z": 1.0}).load_state_dict(a.state_dict())


# --------------------------------------------------------------------------------------------- samplers

TASKS = ["easy"] * 10 + ["mid"] * 10 + ["hard"] * 10


def test_sampler_has_repeat_samplers_layout():
    cur = curriculum_from_tasks(TASKS)
    sampler = CurriculumSampler(TASKS, cur, mini_repeat_count=2, batch_size=3, repeat_count=2, seed=0)
    indices = list(sampler)
    assert len(indices) == len(sampler) == (30 // 3) * 3 * 2 * 2
    for start in range(0, len(indices), 12):  # chunk: 3 rows x 2 copies, twice
        block = indices[start : start + 12]
        assert block[:6] == block[6:]
        assert block[0:6:2] == block[1:6:2]


def test_sampler_follows_the_weights_it_reads_at_each_chunk():
    cur = curriculum_from_tasks(TASKS, floor=0.01)
    sampler = CurriculumSampler(TASKS, cur, mini_repeat_count=1, batch_size=10, seed=0)
    stream = iter(sampler)
    first = Counter(TASKS[next(stream)] for _ in range(10))
    assert len(first) >= 2  # the uniform start draws from several tasks
    for _ in range(20):  # easy always solved, hard never: mid takes over
        cur.update(*batch({"easy": 1.0, "mid": 0.5, "hard": 0.0}))
    later = Counter(TASKS[next(stream)] for _ in range(20))  # the epoch's other two chunks
    assert later["mid"] >= 16
    # deterministic: the same seed and the same weights draw the same rows
    a = CurriculumSampler(TASKS, curriculum_from_tasks(TASKS), mini_repeat_count=1, batch_size=10, seed=5)
    b = CurriculumSampler(TASKS, curriculum_from_tasks(TASKS), mini_repeat_count=1, batch_size=10, seed=5)
    assert list(a) == list(b)


def test_sampler_cycles_a_task_before_repeating_a_row():
    tasks = ["a"] * 4 + ["b"] * 100
    cur = Curriculum({"a": 1000.0, "b": 1.0})  # nearly always "a"
    indices = list(CurriculumSampler(tasks, cur, mini_repeat_count=1, batch_size=4, seed=3))[:8]
    a_rows = [i for i in indices if i < 4]
    assert sorted(a_rows[:4]) == [0, 1, 2, 3]


def test_prompt_stream_follows_weights_and_counts_position():
    rows = [{"prompt": f"q{i}", "task": t} for i, t in enumerate(TASKS)]
    cur = curriculum_from_tasks(TASKS, floor=0.01)
    stream = CurriculumPromptStream(rows, cur, seed=0)
    stream.take(6)
    assert stream.position == 6
    for _ in range(20):
        cur.update(*batch({"easy": 1.0, "mid": 0.5, "hard": 0.0}))
    assert Counter(r["task"] for r in stream.take(40))["mid"] >= 32
    with pytest.raises(ValueError, match="not in the curriculum"):
        CurriculumPromptStream([{"prompt": "q", "task": "other"}], cur, seed=0)


# --------------------------------------------------------------------------------------------- TRL trainer


def task_reward(completions, task, **kwargs):
    """easy: always 1, hard: always 0, mid: 1 for about half the completions (a hash of the text)."""
    out = []
    for completion, t in zip(completions, task, strict=True):
        text = completion[0]["content"]
        out.append({"easy": 1.0, "hard": 0.0}.get(t, float(zlib.crc32(text.encode()) % 2)))
    return out


@pytest.mark.slow
def test_trainer_curriculum_logs_weights_and_moves_to_informative_task(tiny_model_path, tmp_path):
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    n = 12
    tasks = ["easy"] * n + ["mid"] * n + ["hard"] * n
    prompts = [[{"role": "user", "content": f"What is {i} + 4?"}] for i in range(len(tasks))]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=12,
        num_generations=4,
        max_completion_length=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_steps=6,
        curriculum=True,
        curriculum_ema=0.8,
        curriculum_floor=0.01,
    )
    data = Dataset.from_dict({"prompt": prompts, "task": tasks})
    trainer = GRPOTrainer(tiny_model_path, [task_reward], args=args, train_dataset=data)
    seen = []
    original = trainer._calculate_rewards

    def spy(inputs, *rest):
        seen.append([x["task"] for x in inputs])
        return original(inputs, *rest)

    trainer._calculate_rewards = spy
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6
    for entry in logs:
        for task in ("easy", "mid", "hard"):
            assert 0.0 <= entry[f"curriculum/{task}/weight"] <= 1.0
            assert 0.0 <= entry[f"curriculum/{task}/pass_rate"] <= 1.0
    last = logs[-1]
    assert last["curriculum/easy/pass_rate"] > 0.9 and last["curriculum/hard/pass_rate"] < 0.1
    assert last["curriculum/mid/weight"] > 0.6
    # the prompts drawn late in the run are mostly of the informative task (the sampler lags one batch)
    late = Counter(t for batch_tasks in seen[-3:] for t in batch_tasks)
    assert late["mid"] > 0.6 * sum(late.values())
    assert trainer.curriculum.updates == len(seen)


def test_trainer_curriculum_needs_a_task_column(tiny_model_path, tmp_path):
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        curriculum=True,
        num_generations=2,
        per_device_train_batch_size=2,
    )
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    with pytest.raises(ValueError, match="task"):
        GRPOTrainer(tiny_model_path, [task_reward], args=args, train_dataset=data)


def _recipe_main():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / "gsm8k_grpo.py"
    spec = importlib.util.spec_from_file_location("gsm8k_grpo_curriculum", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_recipe_runs_curriculum_with_dynamic_sampling(tiny_model_path, tmp_path):
    import json

    out = tmp_path / "run"
    argv = [
        "--model_name_or_path", tiny_model_path, "--output_dir", str(out), "--max_completion_length", "6",
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--eval_num_samples", "0",
        "--synthetic_tasks", "chain_sum_easy:3,chain_sum:1", "--max_steps", "2", "--report_to", "none",
        "--curriculum", "true", "--dynamic_sampling", "true", "--max_generation_batches", "2",
    ]  # fmt: skip
    assert _recipe_main()(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("curriculum/chain_sum_easy/weight", "curriculum/chain_sum/pass_rate", "generation_batches",
                "frac_degenerate_before_filter", "frac_degenerate"):  # fmt: skip
        assert key in rows[0], key
    assert 1 <= rows[0]["generation_batches"] <= 2


def test_recipe_refuses_curriculum_without_tasks(tiny_model_path, tmp_path, capsys):
    import json

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    argv = ["--model_name_or_path", tiny_model_path, "--output_dir", str(out), "--dataset_name", str(data),
            "--curriculum", "true", "--max_steps", "1", "--report_to", "none"]  # fmt: skip
    assert _recipe_main()(argv) == 2
    assert "curriculum" in capsys.readouterr().err and not out.exists()


@pytest.mark.slow
def test_checkpoint_carries_the_curriculum_state(tiny_model_path, tmp_path):
    import json

    from trl_grpo_ext.trl.sampling import CURRICULUM_STATE_FILENAME
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    tasks = ["easy"] * 8 + ["hard"] * 8
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"{i} + 4?"}] for i in range(16)], "task": tasks}
    )

    def make(max_steps):
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
            per_device_train_batch_size=4, num_generations=2, max_completion_length=3, logging_steps=1,
            save_strategy="steps", save_steps=2, max_steps=max_steps, seed=0, curriculum=True,
        )  # fmt: skip
        return GRPOTrainer(tiny_model_path, [task_reward], args=args, train_dataset=data)

    first = make(2)
    first.train()
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / CURRICULUM_STATE_FILENAME).read_text())
    assert saved == first.curriculum.state_dict() and saved["updates"] == 2
    assert saved["pass_rates"]["easy"] > 0.5 > saved["pass_rates"]["hard"]
    resumed = make(3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.curriculum.updates == 3  # the saved two, then step 3's
