"""The two asynchronous embedded recipes as users run them: each YAML file as written, on the embedded model offline,
shortened to 2 steps (with short completions and 2 prompts a step), through its own entry point in a fresh process
(an asynchronous run pins its threads to cores). What is checked: the mode is said at start, the second step trained
on a batch drawn one step behind, and the run files are written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_grpo_ext.runs import METRICS_FILENAME, read_metrics_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--max_steps", "2", "--max_completion_length", "12", "--num_train_samples", "24"]
TWO_PROMPTS_TRL = ["--gradient_accumulation_steps", "1"]  # one pass of 8 completions (2 prompts x 4) a step
TWO_PROMPTS_PYTRIO = ["--per_device_train_batch_size", "8"]  # the same 2 prompts x 4 on the PyTRIO path


def _run(script: str, recipe: str, out: Path, *extra: str) -> tuple[str, str]:
    """(stdout, stdout + stderr) of the recipe's run, which must succeed."""
    args = [str(ROOT / "recipes" / script), "--config", str(ROOT / recipe), *SHORT, "--output_dir", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return done.stdout, log


def _staleness(out: Path) -> list[float]:
    rows = read_metrics_file(out / METRICS_FILENAME)[0]
    assert [row["step"] for row in rows] == [1, 2]
    return [row["sample/staleness_max"] for row in rows]


def test_the_trl_recipe_runs_asynchronously_on_the_embedded_model(tmp_path):
    out = tmp_path / "trl"
    _, log = _run(
        "gsm8k_grpo.py", "recipes/gsm8k/embedded_async.yaml", out, "--eval_num_samples", "4", *TWO_PROMPTS_TRL
    )
    mode = "asynchronous, sample_ahead 1, max_staleness 1, decoupled objective"
    assert f"sampling: {mode}" in log
    assert "async sampling: sample_ahead 1, max_staleness 1, decoupled objective (behaviour weight" in log
    assert "sampler on core(s)" in log  # the cores each side got
    assert _staleness(out) == [0, 1]  # step 1 has nothing older to train on; step 2 trains step 1's draw
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["eval"]["after"]["n"] == 4


def test_the_pytrio_recipe_runs_asynchronously_on_the_embedded_model(tmp_path):
    out = tmp_path / "pytrio"
    extra = ["--lora_r", "4", "--save_every", "2", *TWO_PROMPTS_PYTRIO]
    printed, log = _run("gsm8k_pytrio.py", "recipes/pytrio/embedded_async.yaml", out, *extra)
    mode = "asynchronous, sample_ahead 1, max_staleness 1, decoupled objective"
    assert f"sampling: {mode}" in log
    assert _staleness(out) == [0, 1]
    summary = json.loads(printed[printed.index("{") :])  # the recipe's last output
    assert summary["steps"] == 2 and summary["sampling_mode"] == mode
