"""The judge end to end: against a real `transformers serve` of a tiny local model (one server for the session),
and in 2-step GRPO runs of `hybrid_judge.yaml` shrunk to the tiny model on both paths; a judge that is down at
start stops both recipes before anything is written; one that goes down mid-run stops it with the last
checkpoint intact."""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from judge_servers import ScriptedServer, TransformersServe, free_port

from trl_grpo_ext.grpo.reward_aggregation import RewardMetricLog
from trl_grpo_ext.task.rewards import make_judge_reward

ROOT = Path(__file__).resolve().parents[1]
RUBRIC = ROOT / "recipes" / "gsm8k" / "judge_rubric.md"
PROMPT = [{"role": "user", "content": "What is 2 + 2?"}]


def build_digit_judge(path):
    """The conftest's tiny random chat model, its LM head cut down so that greedy decoding always answers one
    digit, which digit depending on the input: every other token's row is zero, and the ten digits' rows come in
    opposite pairs (w, -w), so one digit of each pair always has a positive logit."""
    import torch
    from conftest import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digits)) == 10 and tokenizer.unk_token_id not in digits
    head = model.lm_head.weight.data
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(5, head.shape[1], generator=generator)
    head.zero_()
    for pair, row in enumerate(rows):
        head[digits[2 * pair]] = row
        head[digits[2 * pair + 1]] = -row
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def served_judge(tmp_path_factory):
    """`transformers serve` of the digit judge on 127.0.0.1, for the whole session; stopped at its end."""
    folder = build_digit_judge(tmp_path_factory.mktemp("digit-judge"))
    log = tmp_path_factory.mktemp("serve-log") / "transformers_serve.log"
    with TransformersServe(folder, timeout=120, log_path=str(log)) as server:
        yield server


def judge_options(base_url, **overrides):
    """The judge of hybrid_judge.yaml, pointed at `base_url`, its scale the digit judge's (one digit, 0-9)."""
    return {
        "base_url": base_url,
        "model": "auto",
        "rubric_file": str(RUBRIC),
        "score_range": [0, 9],
        "max_tokens": 1,
        "max_concurrency": 4,
        "timeout_s": 60,
        "retries": 1,
        **overrides,
    }


def _score(judge, completions):
    log = RewardMetricLog()
    scores = asyncio.run(judge(completions, prompts=[PROMPT] * len(completions), log_metric=log))
    return scores, log.metrics()


@pytest.mark.slow
def test_judge_against_transformers_serve(served_judge):
    judge = make_judge_reward(judge_options(served_judge.base_url))
    judge.preflight()
    assert judge.config.model.endswith("digit-judge0")  # model: auto, resolved from the server's /v1/models
    completions = [f"The answer is \\boxed{{{n}}}." for n in range(6)]
    scores, metrics = _score(judge, completions)
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores), scores
    assert metrics["judge/requests"] == 6 and metrics["judge/failures"] == 0 and metrics["judge/parse_errors"] == 0
    again, metrics = _score(judge, completions)  # the cache answers: no request reaches the server
    assert again == scores and metrics["judge/requests"] == 0 and metrics["judge/cache_hits"] == 6
    fresh = make_judge_reward(judge_options(served_judge.base_url, cache=False, model=judge.config.model))
    assert _score(fresh, completions)[0] == scores  # temperature 0: the same scores from a new judge


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl_argv(model, out, judge, *extra):
    return [
        "--config", str(ROOT / "recipes" / "gsm8k" / "hybrid_judge.yaml"), "--model_name_or_path", model,
        "--output_dir", str(out), "--max_steps", "2", "--max_completion_length", "8", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--synthetic_tasks", "chain_sum",
        "--save_steps", "1", "--judge", json.dumps(judge), *extra,
    ]  # fmt: skip


def pytrio_argv(model, out, judge, *extra):
    return [
        "--config", str(ROOT / "recipes" / "pytrio" / "hybrid_judge.yaml"), "--base_model", model,
        "--output_dir", str(out), "--max_steps", "2", "--max_completion_length", "8", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--lora_r", "4", "--num_train_samples", "16", "--save_every", "1",
        "--judge", json.dumps(judge), *extra,
    ]  # fmt: skip


# The tiny model's 8 random tokens never hold a box: with hybrid_judge.yaml's vetoes every completion would be vetoed
# and, vetoes coming first, none sent to the judge. These runs are about the judge, so they run without vetoes.
NO_VETOES = ("--hybrid", json.dumps({"components": {"boxed": 0.7, "judge": 0.3, "cost": -0.05}, "vetoes": []}))


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trl", "pytrio"])
def test_two_grpo_steps_of_hybrid_judge_yaml(served_judge, tiny_model_path, tmp_path, path):
    out = tmp_path / "run"
    judge = judge_options(served_judge.base_url)
    if path == "trl":
        assert _load("gsm8k_grpo").main(trl_argv(tiny_model_path, out, judge, *NO_VETOES)) == 0
    else:
        assert _load("gsm8k_pytrio").main(pytrio_argv(tiny_model_path, out, judge, *NO_VETOES)) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["judge/failures"] == 0 and row["judge/parse_errors"] == 0
        assert row["judge/requests"] + row["judge/cache_hits"] > 0
        assert 0.0 <= row["rewards/hybrid_reward/judge"] <= 1.0
        assert 0.0 < row["rewards/hybrid_reward/cost"] <= 1.0  # tokens / max_completion_length
        assert "judge/latency_p50" in row or row["judge/requests"] == 0


@pytest.mark.parametrize("path", ["trl", "pytrio"])
def test_a_judge_down_at_start_stops_the_recipe_before_anything(tiny_model_path, tmp_path, capsys, path):
    out = tmp_path / "run"
    url = f"http://127.0.0.1:{free_port()}/v1"
    judge = judge_options(url)
    if path == "trl":
        code = _load("gsm8k_grpo").main(trl_argv(tiny_model_path, out, judge))
    else:
        code = _load("gsm8k_pytrio").main(pytrio_argv(tiny_model_path, out, judge))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == f"error: judge: cannot reach {url} (ConnectError)"
    assert not out.exists()


@pytest.mark.parametrize("path", ["trl", "pytrio"])
def test_bad_reward_options_stop_the_recipe_in_one_line(tiny_model_path, tmp_path, capsys, path):
    out = tmp_path / "run"
    judge = {"base_url": "127.0.0.1:8000", "model": "m", "rubric": "r", "retries": -1}
    if path == "trl":
        code = _load("gsm8k_grpo").main(trl_argv(tiny_model_path, out, judge))
    else:
        code = _load("gsm8k_pytrio").main(pytrio_argv(tiny_model_path, out, judge))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "judge: base_url='127.0.0.1:8000' must be an http" in err[0]
    assert "retries=-1 must be an integer >= 0" in err[0] and not out.exists()


def _fails_after_first(index, body):
    """One good answer, then 500 for ever: step 1 goes on (one term missing where it failed), step 2 fails whole."""
    return ("ok", "5") if index == 0 else ("status", 500)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trl", "pytrio"])
def test_a_judge_down_for_whole_steps_stops_the_run_with_the_last_checkpoint_intact(
    tiny_model_path, tmp_path, capsys, path
):
    out = tmp_path / "run"
    with ScriptedServer(_fails_after_first) as server:
        judge = judge_options(server.base_url, model="judge", retries=1, max_failed_steps=1)
        extra = ["--max_steps", "3", *NO_VETOES]
        if path == "trl":
            code = _load("gsm8k_grpo").main(trl_argv(tiny_model_path, out, judge, *extra))
        else:
            code = _load("gsm8k_pytrio").main(pytrio_argv(tiny_model_path, out, judge, *extra))
    err = capsys.readouterr().err
    assert code == 1 and f"judge at {server.base_url} failed every request of 1 step(s) in a row" in err
    assert [r["step"] for r in _rows(out)] == [1]  # step 1 ran with its failures counted
    assert _rows(out)[0]["judge/failures"] > 0
    if path == "trl":
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
        state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
        assert state["global_step"] == 1 and (out / "checkpoint-1" / "model.safetensors").is_file()
    else:
        state = json.loads((out / "pytrio_state.json").read_text())
        assert state["step"] == 1 and state["state_path"]


@pytest.mark.slow
def test_a_judge_down_for_one_process_stops_every_process_at_once(tiny_model_path, tmp_path):
    """Each process asks the judge about its own completions; process 0's judge is down, process 1's answers. The
    stop is decided over all processes after the rewards' gather: both stop at the same step, each saying why."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "multiprocess_judge.py"), "--model", tiny_model_path, "--out", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=300, cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "process 0 stopped: judge at http://127.0.0.1:" in log and "of 1 step(s) in a row" in log, log[-3000:]
    assert "process 1 stopped: the judge failed every request of its last steps on process 0" in log, log[-3000:]
