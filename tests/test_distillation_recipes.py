"""The on-policy distillation recipes (recipes/gsm8k/opd.yaml, recipes/pytrio/opd.yaml) and their sweep: they parse,
and run 2 steps on tiny models (student and teacher), the teacher's signal in the metrics."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_model

from trl_grpo_ext.grpo.distillation import DistillationSpec, distillation_of

ROOT = Path(__file__).resolve().parents[1]
TRL_RECIPE = ROOT / "recipes" / "gsm8k" / "opd.yaml"
PYTRIO_RECIPE = ROOT / "recipes" / "pytrio" / "opd.yaml"
SWEEP = ROOT / "recipes" / "sweeps" / "embedded_opd.yaml"
TEACHER = DistillationSpec(teacher="outputs/gsm8k-embedded")


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("opd-teacher") / "teacher", seed=1)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_recipes_parse_with_the_teacher():
    from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    _, training_args, model_args = parse_recipe_args(["--config", str(TRL_RECIPE), "--bf16", "false"])
    assert distillation_of(training_args) == TEACHER and training_args.loss_type == "importance_sampling"
    assert model_args.model_name_or_path == "embedded"
    (config,) = parse_recipe_args(["--config", str(PYTRIO_RECIPE)], dataclass_types=(PyTrioGRPOConfig,))
    assert distillation_of(config) == TEACHER and config.base_model == "embedded"


@pytest.mark.slow
def test_trl_recipe_runs_two_steps_on_tiny_models(tiny_model_path, teacher_path, tmp_path, capsys):
    main = _load(ROOT / "recipes" / "gsm8k_grpo.py", "gsm8k_grpo_opd").main
    out = tmp_path / "opd"
    tiny = ["--model_name_or_path", tiny_model_path, "--max_completion_length", "8", "--per_device_train_batch_size",
            "4", "--num_generations", "2", "--gradient_accumulation_steps", "1", "--eval_num_samples", "0",
            "--synthetic_tasks", "chain_sum", "--bf16", "false", "--max_steps", "2"]  # fmt: skip
    missing = ["--config", str(TRL_RECIPE), *tiny, "--output_dir", str(out)]
    missing += ["--distillation", json.dumps({"teacher": str(tmp_path / "no-teacher")})]
    assert main(missing) == 2  # the teacher is checked before anything is written
    assert "distillation.teacher" in capsys.readouterr().err and not out.exists()
    argv = ["--config", str(TRL_RECIPE), *tiny, "--output_dir", str(out)]
    assert main([*argv, "--distillation", json.dumps({"teacher": teacher_path})]) == 0
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2]
    for row in logged:
        assert abs(row["distill/reverse_kl"]) > 1e-4 and "reward" in row and "distill/advantage_std" in row


@pytest.mark.slow
def test_pytrio_recipe_runs_two_steps_on_tiny_models(tiny_model_path, teacher_path, tmp_path, capfd):
    main = _load(ROOT / "recipes" / "gsm8k_pytrio.py", "gsm8k_pytrio_opd").main
    out = tmp_path / "opd-pytrio"
    argv = ["--config", str(PYTRIO_RECIPE), "--base_model", tiny_model_path, "--lora_r", "4", "--max_steps", "2",
            "--max_completion_length", "8", "--num_train_samples", "16", "--per_device_train_batch_size", "8",
            "--save_every", "0", "--output_dir", str(out), "--distillation", json.dumps({"teacher": teacher_path})]  # fmt: skip
    assert main(argv) == 0  # the local server serves the student and, for log-probs, the teacher
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2]
    for row in logged:
        assert abs(row["distill/reverse_kl"]) > 1e-4 and "reward" in row and "distill/teacher_logp" in row


def test_sweep_is_valid_in_a_dry_run():
    result = subprocess.run(
        [sys.executable, "-m", "trl_grpo_ext.cli", "sweep", str(SWEEP), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("opd") >= 3
