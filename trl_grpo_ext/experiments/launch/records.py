"""What a run's job did, or is doing, recorded in its folder; and the run's state as `sweep --status` shows it.

A run folder's `sweep_attempt.json` is a `RunResult`: written `queued` when a launcher hands the run to a job,
`running` when the job starts, and `finished` / `failed` / `interrupted` / `eval_failed` when it ends. The
scheduler is asked only whether a queued or running record's job still exists (SLURM: squeue; here: the pid), so
no job accounting (sacct, slurmdbd) is needed: a job that vanished without its final record (killed, time limit,
node failure) is a run to resume.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from trl_grpo_ext.experiments.sweep import RunSpec
from trl_grpo_ext.runs import latest_checkpoint
from trl_grpo_ext.runs.sweep_files import (
    has_pytrio_state,
    is_done,
    read_attempt_record,
    update_sweep_summary_entry,
    write_attempt_record,
)

IN_FLIGHT = ("queued", "running")


@dataclass
class RunResult:
    name: str
    status: str  # queued | running | finished | skipped | failed | interrupted | eval_failed
    run_dir: str
    returncode: int | None = None
    wall_time: float | None = None
    command: list[str] | None = None
    resumed_from: str | None = None
    log_tail: str | None = None
    eval: dict | None = None
    finished_at: str | None = None
    started_at: str | None = None
    launcher: str | None = None  # local | slurm
    job_id: str | None = None  # SLURM: <array job>_<task>
    job_log: str | None = None  # SLURM: the array task's own output (the trainer's is the run's train.log)
    host: str | None = None
    pid: int | None = None
    pid_started: float | None = None  # the process's start time: a reused pid is not mistaken for it
    reason: str | None = None  # one line: why it failed or stopped

    @property
    def ok(self) -> bool:
        """Nothing wrong with it: finished, already done, or handed to a job that is still on it."""
        return self.status in ("finished", "skipped", *IN_FLIGHT)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def read_attempt(run_dir: Path) -> RunResult | None:
    """The run's last attempt record, or None (never started, or a record a kill left unreadable)."""
    data = read_attempt_record(run_dir)
    try:
        return RunResult.from_dict(data) if data is not None else None
    except TypeError:
        return None


def write_attempt(record: RunResult) -> None:
    write_attempt_record(record.run_dir, asdict(record))


def update_summary_entry(record: RunResult) -> None:
    """A job's final record, put into its sweep's sweep_summary.json (in the output root, its folder's parent):
    the summary stays current when no sweep command waits for the jobs (SLURM without --wait)."""
    update_sweep_summary_entry(Path(record.run_dir).parent, asdict(record))


def this_process() -> dict:
    """host, pid and pid start time of this process, for a record a later command can check is still alive."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": process_start_time(os.getpid())}


def process_start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def local_process_alive(record: RunResult) -> bool | None:
    """Whether the process a local record names still runs: None when it ran on another host (cannot tell)."""
    if record.host != socket.gethostname():
        return None
    if record.pid is None:
        return False
    started = process_start_time(record.pid)
    return started is not None and (record.pid_started is None or abs(started - record.pid_started) < 1.0)


_ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception|Interrupt)\b:?)")


def failure_reason(log_tail: str | None, returncode: int | None) -> str:
    """One line for `--status`: the log's last error line (a recipe's `error: ...`, a traceback's last line)."""
    lines = [line.strip() for line in (log_tail or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:300]
    return f"exit code {returncode}" if returncode is not None else "no exit code"


class RunState(NamedTuple):
    status: str  # pending | queued | running | done | failed
    detail: str = ""


def resume_point(run_dir: Path) -> str:
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        return f"resumes from {ckpt.name}"
    if has_pytrio_state(run_dir):
        return "resumes from its last saved PyTRIO state"
    return "starts from step 0"


def run_state(run: RunSpec, record: RunResult | None, scheduler) -> RunState:
    """Where `run` stands, from its folder and, for a record of a job in flight, the scheduler
    (`scheduler.lookup(record) -> RunState | None`, None: that job no longer exists)."""
    run_dir = run.run_dir
    if is_done(run_dir):
        if record is not None and record.status == "eval_failed":
            return RunState("done", f"trained; eval failed: {(record.eval or {}).get('error') or record.reason}")
        if record is not None and record.status in IN_FLIGHT:
            live = scheduler.lookup(record)
            if live is not None:
                return RunState(live.status, f"{live.detail}; trained, evaluating")
        return RunState("done")
    if record is None:
        return RunState("pending", "new" if not run_dir.exists() else resume_point(run_dir))
    if record.status in IN_FLIGHT:
        live = scheduler.lookup(record)
        if live is not None:
            return live
        if record.launcher == "slurm":
            where = f"slurm job {record.job_id} ended without recording an exit (killed, time limit or node failure)"
        else:
            where = f"pid {record.pid} ended without recording an exit (killed)"
        return RunState("pending", f"{where}; {resume_point(run_dir)}")
    if record.status in ("failed", "eval_failed"):
        return RunState("failed", record.reason or failure_reason(record.log_tail, record.returncode))
    if record.status == "interrupted":
        return RunState("pending", f"interrupted: {record.reason or 'stopped'}; {resume_point(run_dir)}")
    return RunState("pending", resume_point(run_dir))  # finished, but its done marker is gone
