"""GPU recipes (recipes/gsm8k/gpu_*.yaml): parsed into the real config classes and checked for what a TRL user on
GPUs expects -- vLLM generation (colocated, with and without sleep mode, or on a server), bf16, LoRA, one of our
loss types with TRL's vLLM importance-sampling correction, and batch/length settings that fit together.
(tests/test_recipes.py also parses them with every other recipe: strict keys, nothing dropped.)"""

import glob
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "gsm8k" / "gpu_*.yaml")))
CPU_OVERRIDES = ["--use_cpu", "true", "--bf16", "false"]  # parsed on this CPU machine; the YAML says bf16
MAX_PROMPT_TOKENS = 256  # the one-shot GSM8K prompt, chat template included (~200 at most on GSM8K test)


def _parse(path, *extra):
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    return parse_recipe_args(["--config", path, *CPU_OVERRIDES, *extra])


def test_the_gpu_recipes_cover_colocate_sleep_and_server():
    modes = {}
    for path in GPU_RECIPES:
        raw = yaml.safe_load(Path(path).read_text())
        modes[Path(path).stem] = (raw["vllm_mode"], raw.get("vllm_enable_sleep_mode", False))
    assert ("colocate", False) in modes.values()
    assert ("colocate", True) in modes.values()
    assert any(mode == "server" for mode, _ in modes.values())


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: Path(p).stem)
def test_gpu_recipe_parses_and_uses_vllm_bf16_lora(path):
    from trl_grpo_ext.trl.config import EXTRA_LOSS_TYPES, GRPOConfig

    raw = yaml.safe_load(Path(path).read_text())
    script_args, args, model_args = _parse(path)
    assert type(args) is GRPOConfig
    assert raw["bf16"] is True and raw["dtype"] == "bfloat16"
    assert (
        model_args.use_peft and model_args.lora_r > 0 and model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    )
    assert args.use_vllm and args.vllm_mode in ("colocate", "server")
    assert args.loss_type in EXTRA_LOSS_TYPES
    # Our loss types multiply by TRL's `importance_sampling_ratio` (tests/test_trainer.py checks the arithmetic).
    assert args.vllm_importance_sampling_correction
    assert args.vllm_importance_sampling_mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    assert args.vllm_importance_sampling_clip_max is not None and args.vllm_importance_sampling_clip_max > 1
    if args.vllm_mode == "colocate":
        assert 0 < args.vllm_gpu_memory_utilization <= 0.9
        assert args.vllm_max_model_length >= MAX_PROMPT_TOKENS + args.max_completion_length
    else:
        assert args.vllm_server_base_url.startswith("http") and args.vllm_server_timeout > 0
        assert "trl vllm-serve" in Path(path).read_text()  # the header says how to start the server
    assert script_args.eval_num_samples >= 200
    completions_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert completions_per_step % args.num_generations == 0
    assert args.generation_batch_size % args.num_generations == 0


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: Path(p).stem)
def test_gpu_recipe_runs_offline_on_local_gsm8k(path, tmp_path):
    """The overrides gpu_check.sh passes: local JSONL data and a local model folder parse like the hub names."""
    data = tmp_path / "gsm8k"
    data.mkdir()
    script_args, args, model_args = _parse(
        path, "--dataset_name", str(data), "--model_name_or_path", str(tmp_path), "--max_steps", "5"
    )
    assert script_args.dataset_name == str(data) and model_args.model_name_or_path == str(tmp_path)
    assert args.max_steps == 5 and args.use_vllm


def test_a_bad_vllm_setting_fails_at_parse_time(tmp_path):
    """TRL's own validation runs when the recipe is parsed, before any model or vLLM engine is built."""
    path = tmp_path / "bad.yaml"
    text = Path(GPU_RECIPES[0]).read_text()
    assert "vllm_importance_sampling_clip_max: 3.0\n" in text
    path.write_text(
        text.replace(
            "vllm_importance_sampling_clip_max: 3.0\n",
            "vllm_importance_sampling_clip_max: 3.0\nvllm_importance_sampling_clip_min: 4.0\n",
        )
    )
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min"):
        _parse(str(path))


# ------------------------------------------------------------------------------ bench/gpu_check.sh


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gsm8k_folder(path, n):
    import json

    path.mkdir()
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gpu_check_dry_runs_on_cpu(tmp_path):
    """The script as a GPU box runs it, on the default data (../shared/data/gsm8k), without installing or training."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "out")]
    if not (ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl").exists():
        # A clone without shared/ beside it (the default data): the same dry run on generated GSM8K files.
        cmd += ["--data", str(_gsm8k_folder(tmp_path / "gsm8k", 200))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = proc.stdout
    assert "gpu_check: dry run OK" in out
    install = next(line for line in out.splitlines() if "would run (install)" in line)
    assert "pip install -e" in install and "vllm" in install
    train = next(line for line in out.splitlines() if "would run (train)" in line)
    assert "gpu_colocate.yaml" in train and "--max_steps 20" in train and "--eval_num_samples 0" in train
    evaluation = next(line for line in out.splitlines() if "would run (eval)" in line)
    assert "--limit 200" in evaluation and "--compare_model" in evaluation and "--adapter" in evaluation
    assert "200 test problems" in out
    assert not (tmp_path / "out" / "train").exists()  # nothing ran


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eval-limit", "50"], "test.jsonl has 8 problems, --eval-limit asks for 50"),
        (["--model", "not a model"], "neither a model folder nor a hub id"),
        (["--recipe", str(ROOT / "recipes" / "gsm8k" / "gpu_server.yaml")], "colocated vLLM"),
    ],
)
def test_gpu_check_refuses_bad_input_before_anything_runs(tmp_path, capsys, extra, message):
    gpu_check = _gpu_check()
    data = _gsm8k_folder(tmp_path / "data", 8)
    argv = ["--dry-run", "--data", str(data), "--eval-limit", "4", "--out", str(tmp_path / "out"), *extra]
    assert gpu_check.run(gpu_check.parse_args(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: error:") and message in err and "\n" not in err


def test_gpu_check_accepts_a_local_model_folder_and_small_eval(tmp_path, tiny_model_path, capsys):
    gpu_check = _gpu_check()
    data = _gsm8k_folder(tmp_path / "data", 8)
    args = gpu_check.parse_args(["--dry-run", "--data", str(data), "--model", tiny_model_path, "--eval-limit", "4",
                                 "--steps", "3", "--out", str(tmp_path / "out")])  # fmt: skip
    assert gpu_check.run(args) == 0
    out = capsys.readouterr().out
    assert f"model: local folder {tiny_model_path}" in out and "--max_steps 3" in out and "--limit 4" in out


def test_gpu_check_report_from_run_files(tmp_path):
    """The printed figures: median step time without step 1, vLLM tokens/s without the warm-up call, peaks, accuracy."""
    import json

    gpu_check = _gpu_check()
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    rows = [
        {"step": i, "step_time": t, "reward": r}
        for i, t, r in [(1, 30.0, 0.2), (2, 5.0, 0.3), (3, 7.0, 0.4), (4, 6.0, 0.5)]
    ]
    (out / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = [
        {"completion_tokens": 1000, "seconds": 10.0},
        {"completion_tokens": 30000, "seconds": 2.0},
        {"completion_tokens": 30000, "seconds": 4.0},
    ]
    (out / gpu_check.GENERATION_LOG).write_text("".join(json.dumps(c) + "\n" for c in calls))
    stats = {
        "train_wall_s": 60.0,
        "torch_peak_allocated_gib": 30.0,
        "torch_peak_reserved_gib": 45.5,
        "gpu": "NVIDIA H200",
    }
    (out / gpu_check.TRAIN_STATS).write_text(json.dumps(stats))
    (out / gpu_check.NVIDIA_SMI_LOG).write_text("1024\n51200\n2048\n")
    summary = {"summary": {"pass@1": 0.41, "n": 200}, "compare_summary": {"pass@1": 0.33, "n": 200}}
    (out / "eval_summary.json").write_text(json.dumps(summary))
    report = gpu_check.summarize(str(out))
    assert report["steps"] == 4 and report["step_time_median_s"] == 6.0 and report["step_time_first_s"] == 30.0
    assert report["generation_tokens_per_s"] == 10000.0
    assert report["peak_gpu_memory_gib_nvidia_smi"] == 50.0 and report["peak_gpu_memory_gib_torch_reserved"] == 45.5
    assert (report["accuracy_before"], report["accuracy_after"], report["eval_problems"]) == (0.33, 0.41, 200)
    text = gpu_check.format_report(report)
    assert "6.00 s median" in text and "10,000 completion tokens/s" in text and "0.330 before -> 0.410 after" in text


def test_gpu_check_times_the_call_trl_makes():
    """The training process wraps `VLLMGeneration.generate`; TRL's trainer calls it and unpacks 4 values."""
    import inspect

    import trl
    from trl.generation.vllm_generation import VLLMGeneration

    assert callable(VLLMGeneration.generate)
    source = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    assert "_, completion_ids, logprobs, _ = self.vllm_generation.generate(" in source


def test_gpu_check_train_step_returns_the_recipes_exit_status(tmp_path, capsys):
    """A config error in the training process is its exit status (it was 0, and the eval ran anyway)."""
    gpu_check = _gpu_check()
    code = gpu_check.main(["_train", "--out", str(tmp_path), "--", "--config", str(tmp_path / "missing.yaml")])
    assert code == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / gpu_check.TRAIN_STATS).exists()


# ------------------------------------------------------------------------ bench/gpu_check.sh --offline


def _gpu_offline():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_offline", ROOT / "bench" / "gpu_offline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_offline_dry_run_runs_the_check_on_cpu(tmp_path):
    """What CI runs: the offline check's own code (agreement per loss type with the padding-column tolerance
    measured in the run, the timing table, the JSON) on CPU at a tiny shape, through gpu_check.sh."""
    import json
    import os
    import subprocess
    import sys

    from trl_grpo_ext.trl.config import EXTRA_LOSS_TYPES, TRL_LOSS_TYPES

    env = {**os.environ, "PYTHON": sys.executable}
    out = tmp_path / "out"
    cmd = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--offline", "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "gpu_offline: all checks passed" in proc.stdout
    report = json.loads((out / "gpu_offline.json").read_text())
    assert report["failures"] == [] and report["environment"]["device"] == "cpu"
    rows = report["agreement"]
    assert sorted((r["loss_type"], r["family"]) for r in rows) == sorted(
        [(t, "trl") for t in TRL_LOSS_TYPES] + [(t, "ours") for t in EXTRA_LOSS_TYPES]
    )
    for r in rows:
        assert r["ok"] and r["ours_loss_diff"] <= r["tolerance_loss"] and r["ours_grad_diff"] <= r["tolerance_grad"]
        assert r["padding_column_loss_change"] >= 0 and r["tolerance_grad"] > 0
    assert any(r.get("sdpa_kernels") for r in rows)  # which SDPA kernel ran
    timing = report["timing"]
    assert {(r["completion_tokens"], r["trainer"]) for r in timing} == {
        (length, kind) for length in (16, 32) for kind in ("trl", "ours", "ours_noshare")
    }
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["steps"] == 2 for r in timing)
    assert "tokens/s" in proc.stdout and "tolerance" in proc.stdout


def test_gpu_offline_exits_nonzero_on_a_failed_check(tmp_path, monkeypatch, capsys):
    """A row outside its tolerance, or a phase that crashes, is a failed check: exit status 1, the JSON says which."""
    import json

    gpu_offline = _gpu_offline()
    args = gpu_offline.parse_args(["--dry-run", "--out", str(tmp_path)])
    monkeypatch.setattr(gpu_offline, "write_model", lambda folder, *a: folder)
    row = {"loss_type": "grpo", "family": "trl", "loss_trl": 0.5, "tolerance_loss": 1e-7, "tolerance_grad": 1e-6,
           "ours_noshare_loss_diff": 0.0, "ours_loss_diff": 1e-3, "ours_noshare_grad_diff": 0.0,
           "ours_grad_diff": 1e-2, "ok": False}  # fmt: skip
    monkeypatch.setattr(gpu_offline, "agreement", lambda *a: [row])

    def crash(*a):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_offline, "timing", crash)
    assert gpu_offline.run(args) == 1
    report = json.loads((tmp_path / "gpu_offline.json").read_text())
    assert report["failures"] == [
        "timing: RuntimeError: CUDA out of memory",
        "agreement: grpo (trl) outside tolerance",
    ]
    out = capsys.readouterr().out
    assert "FAILED" in out and "CHECKS FAILED" in out


def test_gpu_check_offline_stops_when_an_install_step_fails(tmp_path):
    """Every step's exit status is checked: a wheel the folder lacks stops the script before the check runs."""
    import os
    import subprocess
    import sys

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("no-such-package-trl-grpo-ext==1.0\n")
    (wheels / "trl_grpo_ext-0.1.0-py3-none-any.whl").write_bytes(b"")
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--offline", "--wheels", str(wheels), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "gpu_check: error: install wheels failed" in proc.stderr
    assert "gpu_offline" not in proc.stdout  # the check did not run
    assert "keeping the installed torch==" in proc.stdout  # the box's torch is a constraint of the install


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "installs from --wheels DIR"),
        (["--wheels", "{tmp}"], "has no requirements.txt or trl_grpo_ext wheel"),
    ],
)
def test_gpu_check_offline_refuses_a_missing_wheel_folder(tmp_path, extra, message):
    import os
    import subprocess
    import sys

    cmd = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--offline", *[e.format(tmp=tmp_path) for e in extra]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2 and message in proc.stderr


def test_offline_model_is_qwen25_05b_shaped():
    """The offline check's model: Qwen2.5-0.5B-Instruct's published config (written by hand, no download)."""
    shape = _gpu_offline().QWEN25_05B
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]) == (896, 24, 14)
    assert (shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]) == (2, 4864, 151936)
    assert shape["tie_word_embeddings"] is True and shape["rope_theta"] == 1e6 and shape["model_type"] == "qwen2"
