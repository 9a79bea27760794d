"""metrics.jsonl writer (fresh runs, resume without lost or duplicated steps), SwanLab mode, greedy eval."""

import json

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from trl_grpo_ext.evaluation import HFGenerator, as_problems, evaluate, greedy_summary
from trl_grpo_ext.runs import EVAL_METRICS_FILENAME, METRICS_FILENAME, read_metrics_file
from trl_grpo_ext.runs.tracking import swanlab_mode
from trl_grpo_ext.trl.callbacks import MetricsJsonlCallback


def _rows(path):
    return read_metrics_file(path)[0]


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])


def _log(cb, args, state, step, **logs):
    state.global_step = step
    cb.on_step_begin(args, state, TrainerControl())
    cb.on_step_end(args, state, TrainerControl())
    cb.on_log(args, state, TrainerControl(), logs=logs)


def test_one_row_per_logged_step_with_trl_keys(args, tmp_path):
    cb, state = MetricsJsonlCallback(), TrainerState()
    cb.on_train_begin(args, state, TrainerControl())
    # TRL's GRPOTrainer logs step_time itself (the seconds of the step's training_step calls)
    _log(
        cb, args, state, 1, reward=0.5, frac_reward_zero_std=0.25, step_time=0.5, **{"rewards/boxed_reward/mean": 0.5}
    )
    _log(cb, args, state, 2, reward=float("nan"), loss=0.1, step_time=0.25)
    cb.on_log(args, state, TrainerControl(), logs={"train_runtime": 3.0, "train_loss": 0.1})  # end summary: skipped
    cb.on_log(args, state, TrainerControl(), logs={"eval_reward": 0.7, "epoch": 1.0})  # eval goes elsewhere
    rows = _rows(tmp_path / METRICS_FILENAME)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward"] == 0.5 and rows[0]["rewards/boxed_reward/mean"] == 0.5
    assert rows[0]["frac_reward_zero_std"] == 0.25
    assert rows[1]["reward"] is None  # NaN is not JSON
    assert all(isinstance(r["step_time"], float) and r["step_time"] >= 0 for r in rows)
    assert _rows(tmp_path / EVAL_METRICS_FILENAME)[0]["eval_reward"] == 0.7


def test_fresh_run_replaces_an_old_file(args, tmp_path):
    (tmp_path / METRICS_FILENAME).write_text(json.dumps({"step": 7, "reward": 1.0}) + "\n")
    cb, state = MetricsJsonlCallback(), TrainerState()
    cb.on_train_begin(args, state, TrainerControl())
    _log(cb, args, state, 1, reward=0.0)
    assert [r["step"] for r in _rows(tmp_path / METRICS_FILENAME)] == [1]


def test_resume_drops_rows_after_the_checkpoint_and_a_torn_line(args, tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_text(
        "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "rew'
    )
    cb, state = MetricsJsonlCallback(), TrainerState()
    state.global_step = 3  # resumed from checkpoint-3: steps 4-5 run again
    cb.on_train_begin(args, state, TrainerControl())
    assert [r["step"] for r in _rows(path)] == [1, 2, 3]
    for step in (4, 5, 6):
        _log(cb, args, state, step, reward=1.0)
    assert [r["step"] for r in _rows(path)] == [1, 2, 3, 4, 5, 6]


def test_only_the_main_process_writes(args, tmp_path):
    cb, state = MetricsJsonlCallback(), TrainerState()
    state.is_world_process_zero = False
    cb.on_train_begin(args, state, TrainerControl())
    _log(cb, args, state, 1, reward=0.0)
    assert not (tmp_path / METRICS_FILENAME).exists()


def test_swanlab_mode_precedence(monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent-home")  # no saved key
    assert swanlab_mode("local") == "local"
    monkeypatch.setenv("SWANLAB_API_KEY", "x" * 21)
    assert swanlab_mode() == "online"
    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    assert swanlab_mode() == "disabled"


def greedy_accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int, batch_size: int = 16) -> dict:
    """Greedy held-out figures of a model in memory, as `BeforeAfterEvalCallback` computes them: the generator
    borrows the model (and gives back its mode and the tokenizer's padding side), `evaluate`, `greedy_summary`."""
    with HFGenerator.borrowing(model, tokenizer, max_new_tokens) as gen:
        results, _ = evaluate(as_problems(problems), gen, 1, batch_size, progress=False)
    return greedy_summary(results)


def test_greedy_accuracy_on_tiny_model(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.task.data import build_prompt

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    problems = [{"prompt": build_prompt(q), "answer": a} for q, a in [("1 + 2 =", "#### 3"), ("2 * 5 =", "#### 10")]]
    problems.append({"prompt": build_prompt("3 - 1 =", chat=False), "answer": "#### 2"})
    result = greedy_accuracy(model, tokenizer, problems, max_new_tokens=4, batch_size=2)
    assert result["n"] == 3
    assert 0.0 <= result["accuracy"] <= result["boxed_rate"] <= 1.0
    assert 0 < result["mean_length"] <= 4
    assert tokenizer.padding_side == AutoTokenizer.from_pretrained(tiny_model_path).padding_side
    assert model.training is False
