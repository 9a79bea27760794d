"""`trl-grpo-ext sweep`: expansion, naming, skipping, resuming and failure handling with a fake recipe,
plus one real tiny TRL run when the TRL recipe is present."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from sweep_fakes import FAKE_RECIPE, TINY_RUN

from trl_grpo_ext.experiments.launch.commands import build_command, describe_runs, eval_command, log_tail, run_status
from trl_grpo_ext.experiments.launch.runner import run_sweep
from trl_grpo_ext.experiments.sweep import (
    expand,
    format_value,
    latest_checkpoint,
    load_sweep,
    parse_sweep,
    sanitize_name,
    validate_runs,
)
from trl_grpo_ext.runs import SWEEP_DONE_FILENAME as DONE_MARKER
from trl_grpo_ext.runs import SWEEP_SUMMARY_FILENAME as SUMMARY_FILE
from trl_grpo_ext.runs import TRAIN_LOG_FILENAME as TRAIN_LOG

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_sweep(tmp_path):
    """Write a base recipe, the fake script and a sweep file; return a function making variants of it."""
    (tmp_path / "fake_recipe.py").write_text(FAKE_RECIPE)
    (tmp_path / "base.yaml").write_text(
        "max_steps: 3\nlearning_rate: 1.0e-6\nloss_type: importance_sampling\nseed: 1\n"
    )

    def make(**changes):
        data = {
            "name": "fake",
            "base": "base.yaml",
            "output_root": str(tmp_path / "runs"),
            "scripts": {"trl": "fake_recipe.py"},
            "grid": {"loss_type": ["ppo", "cispo"], "learning_rate": ["1e-5", "4e-5"]},
            "overrides": {"max_steps": 2},
        }
        data.update(changes)
        path = tmp_path / "sweep.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return load_sweep(path)

    return make


def invocations(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "invocations.jsonl").read_text().splitlines()]


def test_expansion_names_and_configs(fake_sweep, tmp_path):
    spec = fake_sweep()
    runs = expand(spec)
    assert [r.name for r in runs] == [
        "loss_type=ppo,learning_rate=1e-05",
        "loss_type=ppo,learning_rate=4e-05",
        "loss_type=cispo,learning_rate=1e-05",
        "loss_type=cispo,learning_rate=4e-05",
    ]
    r = runs[1]
    assert r.params == {"loss_type": "ppo", "learning_rate": 4e-05}
    assert r.config["learning_rate"] == 4e-05 and isinstance(r.config["learning_rate"], float)  # "4e-5" -> float
    assert r.config["max_steps"] == 2 and r.config["seed"] == 1  # override beats base; base kept
    assert r.config["output_dir"] == str(tmp_path / "runs" / r.name)
    assert r.config["run_name"] == r.name
    assert [x.name for x in expand(spec)] == [x.name for x in runs]  # deterministic


def test_variants_backend_and_overrides(fake_sweep, tmp_path):
    spec = fake_sweep(
        grid={"backend": ["trl", "pytrio"]},
        variants=[{"loss_type": "ppo"}, {"loss_type": "cispo", "cispo_clip_high": 5.0}],
        backend_overrides={"pytrio": {"base_model": "embedded"}},
        scripts={"trl": "fake_recipe.py", "pytrio": "fake_recipe.py"},
    )
    runs = expand(spec)
    assert [r.name for r in runs] == [
        "loss_type=ppo,backend=trl",
        "loss_type=ppo,backend=pytrio",
        "loss_type=cispo,cispo_clip_high=5.0,backend=trl",
        "loss_type=cispo,cispo_clip_high=5.0,backend=pytrio",
    ]
    assert [r.backend for r in runs] == ["trl", "pytrio"] * 2
    assert all("backend" not in r.config for r in runs)
    assert runs[1].config["base_model"] == "embedded" and "base_model" not in runs[0].config


def test_names_are_path_safe():
    assert format_value(4e-05) == "4e-05" and format_value([1, 2]) == "1+2" and format_value(True) == "True"
    assert sanitize_name("model=org/model name,lr=1e-05") == "model=org_model_name,lr=1e-05"
    for evil in ("../../etc", "..", ".hidden", "a/b\\c"):
        name = sanitize_name(evil)
        assert "/" not in name and "\\" not in name and not name.startswith(".") and name
    long = sanitize_name("k=" + "x" * 400)
    assert len(long) <= 150 and long != sanitize_name("k=" + "x" * 399)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"grid": {"lr": []}}, "no values"),
        ({"grid": {"lr": [1, 1]}}, "twice"),
        ({"gird": {"lr": [1]}}, "unknown sweep keys"),
        ({"grid": {"output_dir": ["a", "b"]}}, "cannot be swept"),
        ({"grid": {"backend": ["nope"]}}, "unknown backend"),
        ({"base": "missing.yaml"}, "not found"),
        ({"launcher": "srun"}, "launcher"),
        ({"grid": {"a": ["x_y", "x/y"]}}, "same name"),
    ],
)
def test_bad_sweep_files_fail_clearly(tmp_path, data, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        spec = parse_sweep(data, source=tmp_path / "s.yaml")
        expand(spec)


def test_run_skip_fail_and_summary(fake_sweep, capsys):
    spec = fake_sweep(variants=[{"fail_always": False}, {"fail_always": True}], grid={"loss_type": ["ppo"]})
    results, summary_path = run_sweep(spec, progress=False)
    assert [r.status for r in results] == ["finished", "failed"]
    ok_dir, bad_dir = (Path(r.run_dir) for r in results)
    assert (ok_dir / DONE_MARKER).is_file() and not (bad_dir / DONE_MARKER).exists()
    marker = json.loads((ok_dir / DONE_MARKER).read_text())
    assert marker["config"]["loss_type"] == "ppo" and marker["config"]["fail_always"] is False
    assert "training ppo" in (ok_dir / TRAIN_LOG).read_text(errors="replace")
    assert [json.loads(x)["step"] for x in (ok_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    inv = invocations(ok_dir)[0]
    assert inv["group"] == "fake" and inv["exp"] == results[0].name and inv["run_name"] == results[0].name

    summary = json.loads(summary_path.read_text())
    assert summary_path.name == SUMMARY_FILE
    bad = summary["runs"][1]
    assert bad["status"] == "failed" and bad["returncode"] == 7 and "boom" in bad["log_tail"]
    assert summary["counts"] == {"failed": 1, "finished": 1}

    # second pass: the finished run is skipped (not launched again), the failed one retried
    results, _ = run_sweep(spec, progress=False)
    assert [r.status for r in results] == ["skipped", "failed"]
    assert len(invocations(ok_dir)) == 1 and len(invocations(bad_dir)) == 2


def test_interrupted_run_resumes_from_latest_checkpoint(fake_sweep):
    spec = fake_sweep(grid={"loss_type": ["ppo"]}, overrides={"max_steps": 4, "crash_once_at": 3})
    (result,), _ = run_sweep(spec, progress=False)
    run_dir = Path(result.run_dir)
    assert result.status == "failed" and result.returncode == 9
    assert latest_checkpoint(run_dir) == run_dir / "checkpoint-2"
    (run_dir / "checkpoint-7").mkdir()  # a checkpoint killed while saving (no trainer_state.json) is ignored
    assert "resume" in describe_runs(spec, expand(spec))
    (result,), _ = run_sweep(spec, progress=False)
    assert result.status == "finished"
    assert result.resumed_from == str(run_dir / "checkpoint-2")
    assert invocations(run_dir)[-1]["resume"] == str(run_dir / "checkpoint-2")
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_restart_without_checkpoint_sets_old_metrics_aside(fake_sweep):
    spec = fake_sweep(grid={"loss_type": ["ppo"]}, overrides={"max_steps": 2, "crash_once_at": 1})
    run = expand(spec)[0]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "metrics.jsonl").write_text('{"step": 1, "reward": 5}\n')
    (run.run_dir / "crashed").write_text("")
    (result,), _ = run_sweep(spec, progress=False)
    assert result.status == "finished" and result.resumed_from is None
    assert (run.run_dir / "metrics.attempt-1.jsonl").read_text() == '{"step": 1, "reward": 5}\n'
    assert len((run.run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_unknown_recipe_keys_are_caught_before_running(tmp_path, capsys):
    from trl_grpo_ext.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "backend": "pytrio",
                "grid": {"loss_type": ["ppo"]},
                "overrides": {"lora_rnak": 8, "num_train_sample": 64},
                "output_root": str(tmp_path / "runs"),
            }
        )
    )
    spec = load_sweep(path)
    assert validate_runs(spec, expand(spec)) == [
        "loss_type=ppo: the pytrio recipe has no key 'lora_rnak' (did you mean 'lora_r'?)",
        "loss_type=ppo: the pytrio recipe has no key 'num_train_sample' (did you mean 'num_train_samples'?)",
    ]
    assert main(["sweep", str(path), "--dry-run"]) == 2
    assert "lora_rnak" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_pytrio_backend_resumes_through_its_flag(fake_sweep):
    spec = fake_sweep(grid={"loss_type": ["ppo"]}, backend="pytrio", scripts={"pytrio": "fake_recipe.py"})
    run = expand(spec)[0]
    assert run.backend == "pytrio" and build_command(spec, run)[-2:] != ["--resume", "true"]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "pytrio_state.json").write_text("{}")
    assert run_status(run) == "resume"
    assert build_command(spec, run)[-2:] == ["--resume", "true"]


def test_accelerate_launcher_command(fake_sweep, tmp_path):
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\n")
    spec = fake_sweep(
        grid={"loss_type": ["ppo"]}, launcher="accelerate", accelerate_config="acc.yaml", num_processes=2
    )
    cmd = build_command(spec, expand(spec)[0])
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1] == str(tmp_path / "acc.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[cmd.index("--num_processes") + 2] == str(tmp_path / "fake_recipe.py")


def test_a_job_the_sweep_stopped_before_its_handler_was_in_place_is_interrupted_not_failed(tmp_path):
    """A job still starting up (no signal handler, no record yet) dies of the sweep's SIGTERM: on a loaded machine
    that window is wide (the CI run where test_sigterm_stops_trainers_and_records_interruption[2] saw 'failed')."""
    import signal
    import subprocess

    from trl_grpo_ext.experiments.launch.job import Job
    from trl_grpo_ext.experiments.launch.local import _ended

    def job(name):
        (tmp_path / name).mkdir()
        return Job(name, "s", "trl", {}, {}, str(tmp_path / name), ["true"])

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    stopped = _ended(job("stopped"), proc.returncode, stopped=True)
    assert stopped.status == "interrupted" and "stopped by the sweep" in stopped.reason
    assert _ended(job("crashed"), proc.returncode).status == "failed"  # a death the sweep did not cause


@pytest.mark.parametrize("parallel", [1, 2])
def test_sigterm_stops_trainers_and_records_interruption(fake_sweep, tmp_path, parallel):
    import signal
    import subprocess
    import time

    (tmp_path / "slow.py").write_text(
        "import os, sys, time, yaml\n"
        "cfg = yaml.safe_load(open(sys.argv[sys.argv.index('--config') + 1]))\n"
        "os.makedirs(cfg['output_dir'], exist_ok=True)\n"
        "open(os.path.join(cfg['output_dir'], 'pid'), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    spec = fake_sweep(grid={"loss_type": ["ppo", "cispo", "dapo"]}, scripts={"trl": "slow.py"})
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from trl_grpo_ext.cli import main; sys.exit(main())",
            "sweep",
            str(spec.source),
            "--no-progress",
            "--parallel",
            str(parallel),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pid_file = tmp_path / "runs" / "loss_type=ppo" / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline and sweep.poll() is None, sweep.communicate()[0]
        time.sleep(0.1)
    sweep.send_signal(signal.SIGTERM)
    out, _ = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, out
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the trainer was stopped (and reaped), not orphaned
    summary = json.loads((tmp_path / "runs" / SUMMARY_FILE).read_text())
    assert [r["status"] for r in summary["runs"]] == ["interrupted"] * 3


def test_parallel_runs_all(fake_sweep):
    results, _ = run_sweep(fake_sweep(), parallel=2, progress=False)
    assert [r.status for r in results] == ["finished"] * 4


def test_cli_dry_run_and_exit_codes(fake_sweep, tmp_path, capsys):
    from trl_grpo_ext.cli import main

    spec = fake_sweep(grid={"loss_type": ["ppo", "cispo"]}, variants=[{"fail_always": False}])
    path = str(spec.source)
    assert main(["sweep", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 runs" in out and "fail_always=False,loss_type=cispo" in out and "--config" in out
    assert not (tmp_path / "runs").exists()
    assert main(["sweep", path, "--no-progress", "--only", "cispo"]) == 0
    assert "1/1 runs ok" in capsys.readouterr().out
    fake_sweep(grid={"loss_type": ["ppo"]}, variants=[{"fail_always": True}])
    assert main(["sweep", path, "--no-progress"]) == 1
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2


def test_cli_set_overrides_every_run(fake_sweep, tmp_path, capsys):
    from trl_grpo_ext.cli import main
    from trl_grpo_ext.cli.sweep import parse_set_values

    assert parse_set_values(["max_steps=5", "learning_rate=4e-5", "reward_funcs=[boxed, format]"]) == {
        "max_steps": 5,
        "learning_rate": 4e-05,
        "reward_funcs": ["boxed", "format"],
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_set_values(["max_steps"])
    spec = fake_sweep(grid={"loss_type": ["ppo"]})
    assert main(["sweep", str(spec.source), "--no-progress", "--set", "max_steps=3"]) == 0
    run_dir = tmp_path / "runs" / "loss_type=ppo"
    assert yaml.safe_load((run_dir / "sweep_config.yaml").read_text())["max_steps"] == 3
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert main(["sweep", str(spec.source), "--set", "output_dir=x"]) == 2
    assert "set by the sweep" in capsys.readouterr().err


def test_eval_command_picks_saved_model(fake_sweep):
    spec = fake_sweep(grid={"loss_type": ["ppo"]}, evaluate={"data": "embedded", "limit": 4, "k": 2})
    run = expand(spec)[0]
    run.run_dir.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no saved model"):
        eval_command(run, spec.evaluate)
    (run.run_dir / "config.json").write_text("{}")
    cmd = eval_command(run, spec.evaluate)
    assert cmd[cmd.index("--model") + 1] == str(run.run_dir)
    assert cmd[cmd.index("--limit") + 1] == "4" and cmd[cmd.index("--out") + 1].endswith("eval.jsonl")
    assert "--tasks" not in cmd
    run.config["synthetic_tasks"] = "chain_sum_easy"
    assert eval_command(run, spec.evaluate)[-4:-2] == ["--tasks", "chain_sum_easy"]
    (run.run_dir / "adapter_config.json").write_text("{}")
    run.config["model_name_or_path"] = "base-model"
    cmd = eval_command(run, spec.evaluate)
    assert cmd[cmd.index("--model") + 1] == "base-model" and cmd[cmd.index("--adapter") + 1] == str(run.run_dir)


def test_shipped_sweep_files_expand():
    files = sorted((REPO / "recipes" / "sweeps").glob("*.yaml"))
    assert any(f.name == "embedded_losses.yaml" for f in files)
    for f in files:
        spec = load_sweep(f)
        runs = expand(spec)
        assert runs, f
        assert validate_runs(spec, runs) == [], f  # every key is one the recipe accepts
        if f.name == "embedded_losses.yaml":
            assert sorted({r.params["loss_type"] for r in runs}) == ["cispo", "importance_sampling", "ppo"]
            assert len(runs) == 9 and sorted({r.config["seed"] for r in runs}) == [0, 1, 2]  # >= 3 seeds per loss


@pytest.mark.slow
def test_real_tiny_trl_run_resume_eval_and_compare(tiny_model_path, tmp_path):
    """The shipped TRL recipe on the tiny model: a run, an interruption after checkpoint-1, the resume, then
    the sweep's eval of the saved model and a compare report."""
    from trl_grpo_ext.experiments.compare import build_report

    sweep = {
        "name": "tiny",
        "base": str(REPO / "recipes" / "gsm8k" / "embedded.yaml"),
        "output_root": str(tmp_path / "runs"),
        "grid": {"loss_type": ["cispo"]},
        "overrides": {
            "model_name_or_path": tiny_model_path,
            **TINY_RUN,
            "save_strategy": "steps",
            "save_steps": 1,
        },
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep))
    spec = load_sweep(path)
    assert validate_runs(spec, expand(spec)) == []
    (result,), _ = run_sweep(spec, progress=False)
    run_dir = Path(result.run_dir)
    assert result.status == "finished", log_tail(run_dir / TRAIN_LOG)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # as if killed after the first checkpoint: no marker, no checkpoint-2
    (run_dir / DONE_MARKER).unlink()
    shutil.rmtree(run_dir / "checkpoint-2")
    sweep["evaluate"] = {"data": "embedded", "limit": 2, "max_new_tokens": 4, "k": 2, "tasks": "chain_sum_easy"}
    path.write_text(yaml.safe_dump(sweep))
    (result,), _ = run_sweep(load_sweep(path), progress=False)
    assert result.status == "finished", log_tail(run_dir / TRAIN_LOG) + str(result.eval)
    assert result.resumed_from == str(run_dir / "checkpoint-1")
    assert "--resume_from_checkpoint" in result.command
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # step 2 logged once, by the resumed attempt
    assert result.eval["status"] == "finished" and result.eval["n"] == 2 and "pass@1" in result.eval
    assert len((run_dir / "eval.jsonl").read_text().splitlines()) == 2

    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert "| loss_type=cispo | trl | 2 |" in report.table and "eval pass@1" in report.table
    assert os.path.getsize(report.plots["reward"]) > 1000


def test_seeds_axis_expands_every_configuration_once_per_seed(fake_sweep):
    spec = fake_sweep(seeds=[0, 1, 2], grid={"loss_type": ["ppo", "cispo"]})
    runs = expand(spec)
    assert [r.name for r in runs] == [
        f"loss_type={loss},seed={seed}" for seed in (0, 1, 2) for loss in ("ppo", "cispo")
    ]  # seeds outermost: a sweep stopped midway has every configuration at its first seeds
    assert [r.config["seed"] for r in runs] == [0, 0, 1, 1, 2, 2]  # the base recipe's seed 1 is replaced
    assert runs[0].params == {"loss_type": "ppo", "seed": 0}
    assert len({r.run_dir for r in runs}) == 6


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"seeds": [0, 0]}, "seed twice"),
        ({"seeds": ["a"]}, "list of integers"),
        ({"seeds": []}, "list of integers"),
        ({"seeds": [0, 1], "grid": {"seed": [3, 4]}}, "both set the seed"),
    ],
)
def test_bad_seeds_fail_clearly(fake_sweep, changes, message):
    with pytest.raises(ValueError, match=message):
        fake_sweep(**changes)
