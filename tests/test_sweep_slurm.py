"""`trl-grpo-ext sweep --launcher slurm` against a real scheduler (a one-node cluster: `sudo .ci/slurm_up.sh`).

Tests that need the cluster skip only outside CI; with CI=true a missing cluster fails them (.ci/run starts it).
The others (sbatch missing, option checks, how GPU runs are laid out) need no cluster.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from slurm_cluster import require_cluster
from sweep_fakes import FAKE_RECIPE, TINY_RUN

from trl_grpo_ext.experiments.launch import LauncherError
from trl_grpo_ext.experiments.launch.commands import log_tail
from trl_grpo_ext.experiments.launch.job import prepare_job
from trl_grpo_ext.experiments.launch.records import read_attempt
from trl_grpo_ext.experiments.launch.runner import cancel_sweep, format_status, run_sweep, sweep_status
from trl_grpo_ext.experiments.launch.slurm import job_script, plan
from trl_grpo_ext.experiments.sweep import expand, load_sweep, parse_sweep
from trl_grpo_ext.runs.names import SLURM_JOBS_DIRNAME, SWEEP_SUMMARY_FILENAME

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 600  # per wait; a tiny run takes ~20 s on an idle 2-core machine


@pytest.fixture
def slurm_cluster():
    require_cluster()


@pytest.fixture
def cancel_on_exit():
    """Specs whose jobs are cancelled when the test ends, passed or not: the next test gets the node's CPUs."""
    specs = []
    yield specs.append
    for spec in specs:
        try:
            cancel_sweep(spec)
        except Exception:  # noqa: BLE001 - cleanup only
            pass


def write_sweep(tmp_path, filename="s.yaml", **data) -> Path:
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(*args) -> tuple[int, str, str]:
    """The sweep command in a child process, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "trl_grpo_ext.cli", "sweep", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr


def wait_until(condition, what: str, spec, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(log_tail(p) for p in sorted((spec.output_root / SLURM_JOBS_DIRNAME).glob("*.out")))
            pytest.fail(f"timed out waiting for {what}:\n{format_status(spec, sweep_status(spec))}\n{logs}")
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------ no cluster needed


def test_sweep_refuses_clearly_without_sbatch(tmp_path, monkeypatch, capsys):
    from trl_grpo_ext.cli import main

    (tmp_path / "fake.py").write_text(FAKE_RECIPE)
    path = write_sweep(
        tmp_path,
        output_root=str(tmp_path / "runs"),
        scripts={"trl": "fake.py"},
        grid={"max_steps": [1, 2]},
        launcher="slurm",
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["sweep", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sbatch" in err and "--launcher local" in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    path = write_sweep(tmp_path, output_root=str(tmp_path / "runs"), scripts={"trl": "fake.py"}, grid={"seed": [1]})
    assert main(["sweep", str(path), "--launcher", "slurm"]) == 2
    assert "sbatch" in capsys.readouterr().err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "slurm, message",
    [
        ({"gpus": 1}, "unknown slurm keys"),
        ({"gpus_per_run": -1}, "gpus_per_run"),
        ({"cpus_per_run": 0}, "cpus_per_run"),
        ({"mem": "lots"}, "slurm.mem"),
        ({"time": 5400}, "quoted string"),
        ({"time": "soon"}, "not a SLURM time"),
        ({"partition": "a b"}, "one word"),
        ({"extra_sbatch_args": ["--array=0-3"]}, "set by the sweep"),
        ({"extra_sbatch_args": [3]}, "list of strings"),
    ],
)
def test_bad_slurm_options_fail_on_load(tmp_path, slurm, message):
    with pytest.raises(ValueError, match=message):
        parse_sweep({"grid": {"seed": [1]}, "slurm": slurm}, source=tmp_path / "s.yaml")


def test_gpu_runs_are_laid_out_one_array_per_resource_shape(tmp_path):
    """A [trl, pytrio] sweep with 2 GPUs per run: the TRL runs share an array asking each task for 2 GPUs and
    starting the recipe with `accelerate launch --num_processes 2`; the PyTRIO runs share one asking for none."""
    (tmp_path / "fake.py").write_text(FAKE_RECIPE)
    spec = parse_sweep(
        {
            "name": "gpu",
            "output_root": str(tmp_path / "runs"),
            "scripts": {"trl": "fake.py", "pytrio": "fake.py"},
            "grid": {"backend": ["trl", "pytrio"], "loss_type": ["ppo", "cispo"]},
            "slurm": {
                "partition": "gpu",
                "gpus_per_run": 2,
                "cpus_per_run": 16,
                "mem": "64G",
                "time": "1-00:00:00",
                "account": "lab",
                "qos": "normal",
                "extra_sbatch_args": "--constraint=a100 --exclusive",
            },
        },
        source=tmp_path / "s.yaml",
    )
    runs = expand(spec)
    jobs = [(run, prepare_job(spec, run, processes=2 if run.backend == "trl" else 1)) for run in runs]
    (trl_res, trl_jobs), (pytrio_res, pytrio_jobs) = plan(spec, jobs)
    assert [r.backend for r, _ in trl_jobs] == ["trl", "trl"] and [r.backend for r, _ in pytrio_jobs] == ["pytrio"] * 2
    assert trl_res.sbatch_options() == [
        "--nodes=1",
        "--ntasks=1",
        "--partition=gpu",
        "--account=lab",
        "--qos=normal",
        "--cpus-per-task=16",
        "--mem=64G",
        "--time=1-00:00:00",
        "--gres=gpu:2",
        "--constraint=a100",
        "--exclusive",
    ]
    assert "--gres=gpu:2" not in pytrio_res.sbatch_options()
    cmd = trl_jobs[0][1].command
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and cmd[cmd.index("--num_processes") + 1] == "2"
    assert "accelerate.commands.launch" not in pytrio_jobs[0][1].command
    script = job_script(spec, trl_res, tmp_path / "runs.txt", len(trl_jobs), parallel=3)
    assert "#SBATCH --array=0-1%3\n" in script and "#SBATCH --gres=gpu:2\n" in script
    assert script.rstrip().endswith('--index "$SLURM_ARRAY_TASK_ID"')
    # an accelerate config's own process count never overrides the job's GPUs, even 1
    spec.accelerate_config, spec.use_accelerate = str(REPO / "accelerate_configs" / "ddp.yaml"), True
    cmd = prepare_job(spec, runs[0], processes=1).command
    assert cmd[cmd.index("--config_file") + 1].endswith("ddp.yaml") and cmd[cmd.index("--num_processes") + 1] == "1"
    # use_cpu runs of the default TRL recipe ask for no GPU unless gpus_per_run says otherwise
    spec.slurm.gpus_per_run = None
    runs[0].config["use_cpu"] = True
    assert [res.gpus for res, _ in plan(spec, [(runs[0], None), (runs[1], None)])] == [0, 1]


# ------------------------------------------------------------------------------------------ a real cluster


def test_queued_runs_are_never_submitted_twice_and_cancel(slurm_cluster, cancel_on_exit, tmp_path):
    """Jobs held in the queue (--begin in an hour): a second sweep command, under either launcher, starts none
    of their runs again; --cancel empties the queue and the runs go back to pending; --wait then runs them."""
    (tmp_path / "fake.py").write_text(FAKE_RECIPE)
    sweep = {
        "name": "held",
        "output_root": str(tmp_path / "runs"),
        "scripts": {"trl": "fake.py"},
        "grid": {"max_steps": [1, 2, 3]},
        "slurm": {"cpus_per_run": 1, "mem": "200M", "gpus_per_run": 0, "extra_sbatch_args": ["--begin=now+3600"]},
    }
    spec = load_sweep(write_sweep(tmp_path, **sweep))
    cancel_on_exit(spec)
    results, _ = run_sweep(spec, launcher="slurm", progress=False, echo=None)
    assert [r.status for r in results] == ["queued"] * 3
    job_ids = [r.job_id for r in results]
    array = job_ids[0].split("_")[0]
    assert job_ids == [f"{array}_{i}" for i in range(3)]  # one array for the three runs
    assert [state.status for _, state in sweep_status(spec)] == ["queued"] * 3

    code, out, err = cli(spec.source, "--launcher", "slurm", "--no-progress")
    assert code == 0, err
    assert len(list((spec.output_root / SLURM_JOBS_DIRNAME).glob("*.sbatch"))) == 1  # nothing submitted again
    assert [read_attempt(r.run_dir).job_id for r in expand(spec)] == job_ids
    code, out, err = cli(spec.source, "--launcher", "local", "--no-progress")
    assert code == 0 and "already queued" in out, out + err
    assert not any((r.run_dir / "invocations.jsonl").exists() for r in expand(spec))  # none ran here either

    code, out, _ = cli(spec.source, "--status")
    assert code == 0 and out.count("queued") >= 3 and f"job {array}_2" in out, out
    assert len(cancel_sweep(spec)) == 3
    states = [state for _, state in sweep_status(spec)]
    assert [s.status for s in states] == ["pending"] * 3 and "cancelled before it started" in states[0].detail

    # a request SLURM would refuse is said before anything is written
    bad = {
        **sweep,
        "output_root": str(tmp_path / "bad"),
        "slurm": {**sweep["slurm"], "partition": "no_such_partition"},
    }
    bad = load_sweep(write_sweep(tmp_path, "bad.yaml", **bad))
    with pytest.raises(LauncherError, match="no_such_partition.*invalid partition"):
        run_sweep(bad, launcher="slurm", progress=False, echo=None)
    code, out, err = cli(bad.source, "--dry-run", "--launcher", "slurm")
    assert code == 2 and "invalid partition" in err and "job array 1: 3 runs" in out, out + err
    assert not (tmp_path / "bad").exists()

    del sweep["slurm"]["extra_sbatch_args"]
    spec = load_sweep(write_sweep(tmp_path, **sweep))
    results, _ = run_sweep(spec, launcher="slurm", progress=False, echo=None, wait=True)
    assert [r.status for r in results] == ["finished"] * 3, [r.reason for r in results]
    for run in expand(spec):
        (invocation,) = [json.loads(x) for x in (run.run_dir / "invocations.jsonl").read_text().splitlines()]
        assert invocation["job"] and invocation["threads"] == "1"  # inside a SLURM job, 1 thread per CPU
        assert len((run.run_dir / "metrics.jsonl").read_text().splitlines()) == run.config["max_steps"]
    assert [state.status for _, state in sweep_status(spec)] == ["done"] * 3


TINY_OVERRIDES = {**TINY_RUN, "gradient_accumulation_steps": 1, "save_strategy": "no"}
TINY_SLURM = {"cpus_per_run": 1, "mem": "1G", "time": "20:00"}  # use_cpu: the tiny runs ask for no GPU


def tiny_sweep(tmp_path, tiny_model_path, **changes) -> dict:
    sweep = {
        "name": "tiny",
        "base": str(REPO / "recipes" / "gsm8k" / "embedded.yaml"),
        "output_root": str(tmp_path / "runs"),
        "launcher": "slurm",
        "overrides": {"model_name_or_path": tiny_model_path, **TINY_OVERRIDES},
        "slurm": TINY_SLURM,
    }
    sweep.update(changes)
    return sweep


GATED_RECIPE = textwrap.dedent(
    """
    # The TRL recipe, held before its first step until the test opens the gate: the array's first tasks cannot
    # finish (and free their slots) before the test has seen the others queued, however slow the machine.
    import runpy, sys, time
    from pathlib import Path

    GATE = Path({gate!r})
    for _ in range(1800):
        if GATE.exists():
            break
        time.sleep(0.5)
    sys.argv[0] = {recipe!r}
    runpy.run_path({recipe!r}, run_name="__main__")
    """
)


@pytest.mark.slow
def test_tiny_2x2_sweep_on_slurm_status_and_compare(slurm_cluster, cancel_on_exit, tiny_model_path, tmp_path):
    from trl_grpo_ext.experiments.compare import build_report

    gate, recipe = tmp_path / "gate", tmp_path / "gated_recipe.py"
    recipe.write_text(GATED_RECIPE.format(gate=str(gate), recipe=str(REPO / "recipes" / "gsm8k_grpo.py")))
    sweep = tiny_sweep(tmp_path, tiny_model_path, grid={"loss_type": ["cispo", "dapo"], "learning_rate": [1e-5, 4e-5]})
    sweep["scripts"] = {"trl": str(recipe)}
    spec = load_sweep(write_sweep(tmp_path, **sweep))
    cancel_on_exit(spec)
    # --parallel 2: at most 2 tasks of the array at once, so the other 2 are seen queued on any number of cores
    code, out, err = cli(spec.source, "--no-progress", "--parallel", "2")
    assert code == 0 and "4 runs queued or running" in out and "--status" in out, out + err
    assert "#SBATCH --array=0-3%2" in next((spec.output_root / SLURM_JOBS_DIRNAME).glob("*.sbatch")).read_text()
    seen: dict[str, set] = {run.name: set() for run in expand(spec)}
    status_lines = []

    def statuses_seen() -> list[str]:
        code, out, err = cli(spec.source, "--status")
        assert code == 0, err
        status_lines.append(out)
        lines = out.splitlines()[1:]
        for line in lines:
            status, name = line.split()[:2]
            seen[name].add(status)
        return [line.split()[0] for line in lines]

    # the gate holds the first two tasks: the other two stay queued until it opens
    wait_until(lambda: statuses_seen().count("queued") == 2, "two runs queued behind the throttle", spec)
    gate.write_text("")
    wait_until(lambda: all(status == "done" for status in statuses_seen()), "the 4 runs to finish", spec)
    statuses = set().union(*seen.values())
    assert {"queued", "running", "done"} <= statuses, status_lines
    assert "failed" not in statuses and "pending" not in statuses, status_lines
    assert any("running  loss_type=" in s and "(job " in s for s in status_lines), status_lines
    for run in expand(spec):
        rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], run.name
        assert read_attempt(run.run_dir).launcher == "slurm"
    summary = json.loads((spec.output_root / SWEEP_SUMMARY_FILENAME).read_text())
    assert summary["counts"] == {"finished": 4}  # written by the jobs: no sweep command waited for them
    report = build_report([spec.output_root], tmp_path / "report")
    for run in expand(spec):
        assert f"| {run.name} | trl | 2 |" in report.table, report.table


PAUSING_RECIPE = textwrap.dedent(
    """
    # The TRL recipe, paused once after logging step 2 (before checkpoint-2): a job to scancel mid-training.
    import runpy, sys, time
    from pathlib import Path

    import transformers

    import trl_grpo_ext
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    RECIPE = {recipe!r}


    class PauseAfterStep2(transformers.TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            flag = Path(args.output_dir) / "paused"
            if state.global_step == 2 and not flag.exists():
                flag.write_text("")
                time.sleep(900)


    class Trainer(GRPOTrainer):
        def __init__(self, *args, callbacks=None, **kwargs):
            super().__init__(*args, callbacks=[*(callbacks or []), PauseAfterStep2()], **kwargs)


    trl_grpo_ext.GRPOTrainer = Trainer
    sys.argv[0] = RECIPE
    runpy.run_path(RECIPE, run_name="__main__")
    """
)


@pytest.mark.slow
def test_scancel_mid_training_then_rerun_resumes_every_step_once(
    slurm_cluster, cancel_on_exit, tiny_model_path, tmp_path
):
    recipe = tmp_path / "pausing_recipe.py"
    recipe.write_text(PAUSING_RECIPE.format(recipe=str(REPO / "recipes" / "gsm8k_grpo.py")))
    overrides = {"model_name_or_path": tiny_model_path, **TINY_OVERRIDES}
    overrides.update(max_steps=3, save_strategy="steps", save_steps=1)
    sweep = tiny_sweep(tmp_path, tiny_model_path, grid={"loss_type": ["cispo"]}, overrides=overrides)
    sweep["scripts"] = {"trl": str(recipe)}
    spec = load_sweep(write_sweep(tmp_path, **sweep))
    cancel_on_exit(spec)
    (run,) = expand(spec)
    (result,), _ = run_sweep(spec, progress=False, echo=None)
    assert result.status == "queued"
    wait_until(lambda: (run.run_dir / "paused").exists(), "the run to log step 2", spec)
    assert [json.loads(x)["step"] for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    subprocess.run(["scancel", result.job_id], check=True)

    def interrupted():
        record = read_attempt(run.run_dir)
        return record.status == "interrupted" and sweep_status(spec)[0][1].status not in ("queued", "running")

    wait_until(interrupted, "the cancelled job to end", spec, deadline_s=120)
    (state,) = [s for _, s in sweep_status(spec)]
    assert state.status == "pending" and "SIGTERM" in state.detail and "resumes from checkpoint-1" in state.detail
    assert not (run.run_dir / "checkpoint-2").exists()

    code, out, err = cli(spec.source, "--no-progress", "--wait")
    assert code == 0 and "finished" in out, out + err
    record = read_attempt(run.run_dir)
    assert record.resumed_from == str(run.run_dir / "checkpoint-1") and record.job_id != result.job_id
    steps = [json.loads(x)["step"] for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # step 2 was logged by both jobs; the resumed one dropped the first's row


@pytest.mark.slow
def test_bad_config_run_fails_with_its_error_and_the_others_finish(
    slurm_cluster, cancel_on_exit, tiny_model_path, tmp_path
):
    sweep = tiny_sweep(tmp_path, tiny_model_path, grid={"loss_type": ["cispo", "no_such_loss"]})
    spec = load_sweep(write_sweep(tmp_path, **sweep))
    cancel_on_exit(spec)
    code, out, err = cli(spec.source, "--no-progress", "--wait")
    assert code == 1, out + err
    assert "failed: loss_type=no_such_loss: error:" in err and "no_such_loss" in err.split("error:", 1)[1], err
    good, bad = expand(spec)
    assert [json.loads(x)["step"] for x in (good.run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    code, out, _ = cli(spec.source, "--status")
    lines = out.splitlines()[1:]
    assert lines[0].startswith("done     loss_type=cispo"), out
    assert lines[1].startswith("failed   loss_type=no_such_loss") and "(error: " in lines[1], out
    summary = json.loads((spec.output_root / SWEEP_SUMMARY_FILENAME).read_text())
    assert summary["counts"] == {"failed": 1, "finished": 1}
    assert "no_such_loss" in summary["runs"][1]["log_tail"]
