"""One run's job: the only way a sweep trains a run, whether a local child process or a SLURM array task starts it.

    python -m trl_grpo_ext.experiments.launch.job RUN_DIR                    # a local launcher's child process
    python -m trl_grpo_ext.experiments.launch.job --list RUNS.txt --index I   # SLURM array task I (RUNS.txt: one folder a line)

The launcher writes the job's description into the run folder (`sweep_job.json`, with `sweep_config.yaml`); the job
records that it runs, adds the flags that resume from the folder's last complete checkpoint (computed now, not at
submission: an earlier job may have saved more since), trains with its output in `train.log`, writes the done
marker, evaluates if the sweep asks, and records how it ended (`sweep_attempt.json`: exit code, log tail, reason).
SIGTERM or SIGINT (scancel, a time limit, Ctrl-C, the local launcher stopping) records `interrupted` first, then
stops the trainer: the next sweep command resumes the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_grpo_ext.experiments.launch.commands import (
    build_command,
    eval_command,
    log_tail,
    resume_args,
    run_env,
    run_status,
)
from trl_grpo_ext.experiments.launch.records import (
    RunResult,
    failure_reason,
    this_process,
    update_summary_entry,
    write_attempt,
)
from trl_grpo_ext.experiments.sweep import RunSpec, SweepSpec
from trl_grpo_ext.runs import EVAL_LOG_FILENAME, TRAIN_LOG_FILENAME, latest_checkpoint
from trl_grpo_ext.runs.names import slurm_task_output
from trl_grpo_ext.runs.sweep_files import (
    is_done,
    now_iso,
    read_done_marker,
    read_eval_summary,
    read_job_description,
    set_aside_metrics,
    write_done_marker,
    write_job_description,
    write_sweep_config,
)

# Seconds a stopped trainer gets to exit before SIGKILL (SLURM's own KillWait is 30 s by default).
STOP_GRACE_S = 20.0


@dataclass
class Job:
    """What a job needs to train one run, written to `<run_dir>/sweep_job.json` by the launcher."""

    name: str
    sweep: str
    backend: str
    params: dict
    config: dict
    run_dir: str
    command: list[str]  # the training command, without the resume flags
    env: dict[str, str] = field(default_factory=dict)  # the sweep file's `env:`
    evaluate: dict | None = None  # `trl-grpo-ext eval` options, or None
    processes: int = 1  # training processes (GPUs): the job's CPUs are split between them

    @property
    def run(self) -> RunSpec:
        return RunSpec(self.name, self.backend, self.params, self.config, Path(self.run_dir))


def prepare_job(spec: SweepSpec, run: RunSpec, processes: int | None = None) -> Job:
    """Write the run's recipe config and job description into its folder; returns the job. `processes`: the
    training processes the job's resources allow (SLURM: one per GPU), else the sweep's own `num_processes`."""
    command = build_command(spec, run, num_processes=processes, resume=False)
    job = Job(run.name, spec.name, run.backend, run.params, run.config, str(run.run_dir), command, dict(spec.env))
    job.evaluate, job.processes = spec.evaluate, processes or spec.num_processes or 1
    run.run_dir.mkdir(parents=True, exist_ok=True)
    write_sweep_config(run.run_dir, run.config)
    write_job_description(run.run_dir, asdict(job))
    return job


def read_job(run_dir: str | os.PathLike) -> Job:
    return Job(**read_job_description(run_dir))


# ------------------------------------------------------------------------------------------ running it


def _scheduler_identity() -> dict:
    """Which launcher started this job, and its SLURM id (array tasks as <array job>_<task>, as squeue shows them)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return {"launcher": "slurm", "job_id": f"{array_job}_{task}"}
    if os.environ.get("SLURM_JOB_ID"):
        return {"launcher": "slurm", "job_id": os.environ["SLURM_JOB_ID"]}
    return {"launcher": "local", "job_id": None}


def _job_env(job: Job) -> dict:
    env = run_env(job.env, job.sweep, job.name)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus and cpus.isdigit() and "OMP_NUM_THREADS" not in job.env:
        # The allocation decides, not a value exported from the login shell; a sweep's own `env:` wins.
        env["OMP_NUM_THREADS"] = str(max(1, int(cpus) // max(1, job.processes)))
    return env


def _stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _run_logged(cmd: list[str], log_path: Path, env: dict, header: str) -> int:
    with open(log_path, "a", buffering=1) as log:
        log.write(f"\n===== {now_iso()} {header}\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            return proc.wait()
        except BaseException:  # SIGTERM / SIGINT while waiting on it: the trainer goes too
            _stop_process(proc)
            raise


def _train(job: Job, record: RunResult, env: dict) -> None:
    run, run_dir = job.run, Path(job.run_dir)
    resume = resume_args(job.backend, run_dir)
    if run_status(run) == "resume" and not resume:
        # A previous attempt died before its first checkpoint: the retry starts from step 0, so its old
        # metrics would interleave with the new ones. Kept under another name rather than deleted.
        set_aside_metrics(run_dir)
    elif resume:
        record.resumed_from = str(latest_checkpoint(run_dir) or run_dir)
    record.command = job.command + resume
    write_attempt(record)
    print(f"run {job.name}: training" + (f", resuming from {record.resumed_from}" if resume else ""), flush=True)
    start = time.monotonic()
    rc = _run_logged(record.command, run_dir / TRAIN_LOG_FILENAME, env, f"train {job.name}")
    record.wall_time, record.returncode, record.finished_at = round(time.monotonic() - start, 3), rc, now_iso()
    if rc != 0:
        record.status, record.log_tail = "failed", log_tail(run_dir / TRAIN_LOG_FILENAME)
        record.reason = failure_reason(record.log_tail, rc)
        return
    marker = {
        "name": job.name,
        "sweep": job.sweep,
        "backend": job.backend,
        "params": job.params,
        "config": job.config,
        "command": record.command,
        "wall_time": record.wall_time,
        "finished_at": record.finished_at,
        "resumed_from": record.resumed_from,
    }
    write_done_marker(run_dir, marker)
    record.status = "finished"


def _eval_summary(run_dir: Path) -> dict | None:
    try:
        return read_eval_summary(run_dir)
    except ValueError:  # unreadable: evaluate again
        return None


def _evaluate(job: Job, env: dict) -> dict:
    run = job.run
    summary = _eval_summary(run.run_dir)
    if summary is not None:
        return {"status": "skipped", **summary}
    try:
        cmd = eval_command(run, job.evaluate)
    except (FileNotFoundError, ValueError) as e:
        return {"status": "failed", "error": str(e)}
    rc = _run_logged(cmd, run.run_dir / EVAL_LOG_FILENAME, env, f"eval {run.name}")
    summary = _eval_summary(run.run_dir) if rc == 0 else None
    if summary is None:
        tail = log_tail(run.run_dir / EVAL_LOG_FILENAME)
        return {"status": "failed", "returncode": rc, "error": failure_reason(tail, rc), "log_tail": tail}
    return {"status": "finished", **summary}


class _Stopped(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_job(run_dir: str | os.PathLike) -> int:
    """Train (or resume) and evaluate the run in `run_dir`; 0 when it finished, else 1 (128 + N if signal N)."""
    job = read_job(run_dir)
    run_dir = Path(job.run_dir)
    record = RunResult(
        job.name, "running", str(run_dir), started_at=now_iso(), **_scheduler_identity(), **this_process()
    )
    if record.launcher == "slurm":  # the array task's own output, where sbatch's --output puts it
        record.job_log = str(slurm_task_output(run_dir.parent, record.job_id))
    write_attempt(record)

    def stop(signum, frame):
        # Recorded before the trainer is stopped: under SLURM, everything is SIGKILLed a few seconds after SIGTERM.
        by = "SLURM (scancel, time limit or preemption)" if record.launcher == "slurm" else "the sweep or a user"
        record.status, record.reason = "interrupted", f"stopped by {signal.Signals(signum).name} from {by}"
        record.finished_at = now_iso()
        write_attempt(record)
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        env = _job_env(job)
        if is_done(run_dir):  # trained by an earlier job: only its evaluation is left
            record.status = "skipped"
            record.wall_time = read_done_marker(run_dir).get("wall_time")
        else:
            _train(job, record, env)
        if record.status in ("finished", "skipped") and job.evaluate:
            trained, record.status = record.status, "running"  # still this job's: no second eval job starts
            write_attempt(record)
            record.eval = _evaluate(job, env)
            record.status = trained
            if record.eval.get("status") == "failed":
                record.status, record.reason = "eval_failed", f"eval: {record.eval.get('error')}"
    except _Stopped as stopped:
        record.log_tail = log_tail(run_dir / TRAIN_LOG_FILENAME)
        write_attempt(record)
        update_summary_entry(record)
        print(f"run {job.name}: {record.reason}", flush=True)
        return 128 + stopped.signum
    except Exception as e:  # the job's own failure (unwritable folder, missing script): recorded, not lost
        record.status, record.reason, record.finished_at = "failed", f"{type(e).__name__}: {e}", now_iso()
        record.log_tail = record.reason
        write_attempt(record)
        update_summary_entry(record)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    record.finished_at = record.finished_at or now_iso()
    write_attempt(record)
    update_summary_entry(record)
    print(f"run {job.name}: {record.status}" + (f" ({record.reason})" if record.reason else ""), flush=True)
    return 0 if record.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trl_grpo_ext.experiments.launch.job", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", nargs="?", help="the run folder (holding sweep_job.json)")
    parser.add_argument("--list", help="a file of run folders, one a line (a SLURM array's runs)")
    parser.add_argument("--index", type=int, help="which line of --list (0-based): $SLURM_ARRAY_TASK_ID")
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (args.list is None) or (args.list is not None and args.index is None):
        parser.error("give RUN_DIR, or --list FILE --index I")
    if args.list is not None:
        folders = Path(args.list).read_text().splitlines()
        if not 0 <= args.index < len(folders):
            parser.error(f"--index {args.index} is outside {args.list} ({len(folders)} runs)")
        args.run_dir = folders[args.index]
    return run_job(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
