"""The local launcher: each run's job as a child process of the sweep command, `parallel` at a time.

The job is the same one a SLURM array task runs (`python -m trl_grpo_ext.experiments.launch.job RUN_DIR`), with its output
in the run's `train.log`. Ctrl-C or SIGTERM stops the jobs (each stops its trainer and records `interrupted`),
so rerunning the sweep resumes them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from trl_grpo_ext.experiments.launch.commands import log_tail, run_env
from trl_grpo_ext.experiments.launch.job import STOP_GRACE_S, Job
from trl_grpo_ext.experiments.launch.records import IN_FLIGHT, RunResult, failure_reason, read_attempt, write_attempt
from trl_grpo_ext.runs import TRAIN_LOG_FILENAME
from trl_grpo_ext.runs.sweep_files import now_iso

POLL_S = 0.2


def _start(job: Job) -> subprocess.Popen:
    with open(Path(job.run_dir) / TRAIN_LOG_FILENAME, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "trl_grpo_ext.experiments.launch.job", job.run_dir],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=run_env(job.env, job.sweep, job.name),
        )


def _ended(job: Job, returncode: int, stopped: bool = False) -> RunResult:
    """The job's own record of how it ended; one made here when it died before writing it (killed, crashed).
    `stopped`: the sweep itself stopped the job (Ctrl-C, SIGTERM); a job that died of it before its own handler was
    in place (still starting up: the window widens on a loaded machine) was interrupted, not failed."""
    record = read_attempt(Path(job.run_dir))
    if (record is None or record.status in IN_FLIGHT) and stopped:
        record = RunResult(job.name, "interrupted", job.run_dir, returncode=returncode, launcher="local")
        record.reason, record.finished_at = "stopped by the sweep before the job could record it", now_iso()
        write_attempt(record)
    elif record is None or record.status in IN_FLIGHT:
        tail = log_tail(Path(job.run_dir) / TRAIN_LOG_FILENAME)
        record = RunResult(job.name, "failed", job.run_dir, returncode=returncode, log_tail=tail, launcher="local")
        record.reason, record.finished_at = f"the job exited ({failure_reason(tail, returncode)})", now_iso()
        write_attempt(record)
    return record


def never_started(job: Job) -> RunResult:
    record = RunResult(job.name, "interrupted", job.run_dir, launcher="local", finished_at=now_iso())
    record.reason = "the sweep stopped before it started"
    write_attempt(record)
    return record


def run_jobs(jobs: list[Job], parallel: int, on_done: Callable[[RunResult], None]) -> None:
    """Run the jobs, `parallel` at once, in order; `on_done(record)` as each ends. On KeyboardInterrupt (Ctrl-C, or
    SIGTERM turned into one by the caller) the running jobs are stopped, every job is reported, and it re-raises."""
    waiting, running = list(jobs), {}
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                job = waiting.pop(0)
                running[_start(job)] = job
            for proc in [p for p in running if p.poll() is not None]:
                on_done(_ended(running.pop(proc), proc.returncode))
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S + 10  # the job's own grace for its trainer, then some
        for proc, job in running.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            on_done(_ended(job, proc.returncode, stopped=True))
        for job in waiting:
            on_done(never_started(job))
        raise
