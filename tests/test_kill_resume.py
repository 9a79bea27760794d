"""kill -9 of the TRL recipe at three points (the metrics write, a checkpoint save, inside a step), each followed by
`--resume_from_checkpoint true`: every step ends up in metrics.jsonl exactly once and the run ends at max_steps.

The kill points are deterministic: the recipe runs under tests/kill_points.py, and $TRL_GRPO_EXT_TEST_KILL=
"<point>:<step>" makes it SIGKILL itself there. One run folder goes through all three kills, so the test is four short runs of
the tiny model; the first is launched the way `accelerate launch recipes/gsm8k_grpo.py` is, without a thread count.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kill_points import SCRIPT as KILL_POINTS
from kill_points import TEST_KILL_ENV

from trl_grpo_ext.runs import METRICS_FILENAME, is_complete_checkpoint, read_metrics_file

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 6


def _argv(model, out):
    return [
        "--model_name_or_path", model, "--output_dir", str(out), "--max_steps", str(MAX_STEPS),
        "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--max_completion_length", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--eval_num_samples", "0",
        "--synthetic_tasks", "chain_sum", "--report_to", "none",
    ]  # fmt: skip


def _run(cmd, kill: str | None, log: Path):
    """Run `cmd` (a recipe, launched directly or by accelerate), under tests/kill_points.py when `kill` is given."""
    env = {k: v for k, v in os.environ.items() if k not in (TEST_KILL_ENV, "OMP_NUM_THREADS")}
    if kill:
        env[TEST_KILL_ENV] = kill
        script = next(i for i, part in enumerate(cmd) if part.endswith(".py"))
        cmd = [*cmd[:script], str(KILL_POINTS), *cmd[script:]]
    with open(log, "w") as handle:
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=300)
    return proc.returncode, log.read_text(errors="replace")


def _steps(out):
    rows, skipped = read_metrics_file(out / METRICS_FILENAME)
    return [r["step"] for r in rows], skipped


@pytest.mark.slow
def test_kill_at_three_points_then_resume_loses_and_repeats_no_step(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    recipe = [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), *_argv(tiny_model_path, out)]
    # As `accelerate launch recipes/gsm8k_grpo.py` with no accelerate config: it exports OMP_NUM_THREADS=1.
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", *recipe[1:]]  # fmt: skip
    resume = [*recipe, "--resume_from_checkpoint", "true"]
    cores = len(os.sched_getaffinity(0))

    # 1. killed while writing step 3's row: half a line is left, checkpoint-2 is complete
    code, log = _run(accelerate, "metrics:3", tmp_path / "1.log")
    assert code != 0 and f"torch threads: {cores}" in log, log[-3000:]  # not 1: the recipe took the cores back
    assert _steps(out) == ([1, 2], 1), log[-3000:]
    assert not (out / METRICS_FILENAME).read_text().endswith("\n")
    assert is_complete_checkpoint(out / "checkpoint-2")

    # 2. resumed from checkpoint-2 (the torn row is dropped, step 3 runs again), killed inside checkpoint-4's save
    code, log = _run(resume, "save:4", tmp_path / "2.log")
    assert code == -signal.SIGKILL, log[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in log
    assert _steps(out) == ([1, 2, 3, 4], 0)
    assert (out / "checkpoint-4" / "model.safetensors").exists() and not is_complete_checkpoint(out / "checkpoint-4")

    # 3. the half-saved checkpoint-4 is passed over: resumed from checkpoint-2 again; killed after step 5's update
    code, log = _run(resume, "step:5", tmp_path / "3.log")
    assert code == -signal.SIGKILL, log[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in log
    assert _steps(out) == ([1, 2, 3, 4], 0) and is_complete_checkpoint(out / "checkpoint-4")

    # 4. resumed from checkpoint-4, runs to the end
    code, log = _run(resume, None, tmp_path / "4.log")
    assert code == 0, log[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in log
    assert _steps(out) == (list(range(1, MAX_STEPS + 1)), 0)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["logged_steps"] == MAX_STEPS
    state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS


def _pytrio_args(tiny_model_path, out):
    return [
        "--config", str(ROOT / "recipes" / "pytrio" / "embedded.yaml"), "--base_model", tiny_model_path,
        "--lora_r", "4", "--max_steps", "3", "--save_every", "1", "--max_completion_length", "8",
        "--num_train_samples", "16", "--output_dir", str(out),
    ]  # fmt: skip


def _pytrio_resume(args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_pytrio_kill", ROOT / "recipes" / "gsm8k_pytrio.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe.main([*args, "--resume", "true"])


@pytest.mark.slow
def test_pytrio_recipe_killed_mid_row_resumes_without_a_glued_row(tiny_model_path, tmp_path):
    """The PyTRIO loop appends through the same `append_jsonl_row`: killed halfway through step 3's row (after the
    step-2 checkpoint), `--resume true` drops the fragment and logs step 3 once."""
    out = tmp_path / "pytrio"
    args = _pytrio_args(tiny_model_path, out)
    code, log = _run(
        [sys.executable, str(ROOT / "recipes" / "gsm8k_pytrio.py"), *args], "metrics:3", tmp_path / "p.log"
    )
    assert code == -signal.SIGKILL, log[-3000:]
    assert _steps(out) == ([1, 2], 1)
    assert _pytrio_resume(args) == 0
    assert _steps(out) == ([1, 2, 3], 0)


@pytest.mark.slow
def test_pytrio_recipe_killed_during_a_save_resumes_from_the_previous_checkpoint(tiny_model_path, tmp_path):
    """Killed after step 2's checkpoint is saved remotely but before the loop state records it: the state still
    names step 1's checkpoint, so `--resume true` drops step 2's row, trains steps 2 and 3 again and logs each once."""
    from trl_grpo_ext.runs.loop_state import load_loop_state

    out = tmp_path / "pytrio"
    args = _pytrio_args(tiny_model_path, out)
    code, log = _run([sys.executable, str(ROOT / "recipes" / "gsm8k_pytrio.py"), *args], "save:2", tmp_path / "p.log")
    assert code == -signal.SIGKILL, log[-3000:]
    assert _steps(out) == ([1, 2], 0)
    state = load_loop_state(out)
    assert state.step == 1 and [c["step"] for c in state.checkpoints] == [1]
    assert _pytrio_resume(args) == 0
    assert _steps(out) == ([1, 2, 3], 0)
    state = load_loop_state(out)
    assert state.step == 3 and [c["step"] for c in state.checkpoints] == [1, 2, 3]
