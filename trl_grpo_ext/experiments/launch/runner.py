"""The sweep command's side of launching: which runs to start, starting them, following them, summarizing them.

`run_sweep` holds the output root's lock while it picks runs and hands them to jobs, so two sweep commands never
start the same run, and a run whose job is still queued or running (a live pid here, a job squeue lists) is left
to it. Finished runs are skipped; a run that failed or was interrupted gets a new job, which resumes it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from trl_grpo_ext.experiments.launch import LauncherError, local, slurm
from trl_grpo_ext.experiments.launch.job import prepare_job
from trl_grpo_ext.experiments.launch.records import (
    IN_FLIGHT,
    RunResult,
    RunState,
    local_process_alive,
    read_attempt,
    run_state,
    this_process,
    write_attempt,
)
from trl_grpo_ext.experiments.sweep import RunSpec, SweepSpec, expand
from trl_grpo_ext.experiments.sweep_options import LAUNCHERS
from trl_grpo_ext.progress import progress_bar
from trl_grpo_ext.runs import TRAIN_LOG_FILENAME
from trl_grpo_ext.runs.sweep_files import (
    append_sweep_log,
    is_done,
    now_iso,
    output_root_lock,
    read_done_marker,
    read_eval_summary,
    read_sweep_summary,
    summary_counts,
    write_sweep_summary,
)

WAIT_POLL_S = 2.0  # how often `--wait` reads the run folders and squeue


class Scheduler:
    """Whether the job a queued/running record names still exists: a local pid, or a job squeue lists."""

    def __init__(self):
        self._queue = slurm.SlurmQueue()

    def lookup(self, record: RunResult) -> RunState | None:
        if record.launcher == "slurm":
            try:
                return self._queue.lookup(record)
            except LauncherError as e:  # no squeue here, or the controller is down: assume it still runs
                return RunState(record.status, f"job {record.job_id}; cannot ask SLURM ({e})")
        alive = local_process_alive(record)
        if alive is None:
            return RunState(record.status, f"pid {record.pid} on {record.host}; cannot check from here")
        return RunState(record.status, f"pid {record.pid}") if alive else None


def _stop_on_sigterm():
    """Treat SIGTERM (a scheduler's or `kill`'s stop) like Ctrl-C: stop the jobs, write the summary."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def _skipped(run: RunSpec) -> RunResult:
    """A finished run this command leaves alone (noting when the sweep now gives it another config)."""
    result = RunResult(run.name, "skipped", str(run.run_dir))
    marker = read_done_marker(run.run_dir)
    result.wall_time = marker.get("wall_time")
    if marker.get("config") != run.config:
        result.log_tail = "finished with a different config than the sweep now gives; pass --force to rerun"
    previous = read_attempt(run.run_dir)
    if previous is not None and previous.eval is not None:
        result.eval = previous.eval
    return result


def _evaluated(run: RunSpec) -> bool:
    try:
        return read_eval_summary(run.run_dir) is not None
    except ValueError:  # unreadable: its job evaluates again
        return False


def _pick(spec: SweepSpec, runs: list[RunSpec], force: bool, scheduler: Scheduler):
    """(runs to start, results of runs left alone: finished, or in a job that is still queued or running)."""
    start, left = [], []
    for run in runs:
        record = read_attempt(run.run_dir)
        live = scheduler.lookup(record) if record is not None and record.status in IN_FLIGHT else None
        if live is not None:
            record.status, record.reason = live.status, f"already {live.status} ({live.detail}); not started again"
            left.append(record)
            continue
        if force and run.run_dir.exists():
            shutil.rmtree(run.run_dir)
        if is_done(run.run_dir) and not (spec.evaluate and not _evaluated(run)):
            left.append(_skipped(run))
        else:
            start.append(run)  # new, failed, interrupted, or finished but not yet evaluated
    return start, left


def _prepare(spec: SweepSpec, runs: list[RunSpec], launcher: str):
    """Write each run's job description; a run whose job cannot be built is recorded failed, not the sweep's end."""
    jobs, failed = [], []
    for run in runs:
        try:
            # SLURM: one training process per GPU the job gets, whatever an accelerate config file says.
            processes = max(1, slurm.run_gpus(spec, run)) if launcher == "slurm" else None
            jobs.append((run, prepare_job(spec, run, processes)))
        except (OSError, ValueError) as e:
            record = RunResult(
                run.name, "failed", str(run.run_dir), reason=f"{type(e).__name__}: {e}", finished_at=now_iso()
            )
            record.log_tail = record.reason
            failed.append(record)
    return jobs, failed


def run_sweep(
    spec: SweepSpec,
    runs: list[RunSpec] | None = None,
    parallel: int | None = None,
    force: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
    launcher: str | None = None,
    wait: bool | None = None,
) -> tuple[list[RunResult], Path]:
    """Start every run of `spec` that is not finished or already in a job, then (local; SLURM with `wait`) follow
    them to their end. Returns one result per run (SLURM without `wait`: `queued`) and the summary file's path."""
    runs = expand(spec) if runs is None else runs
    spec, launcher, parallel = _launch_settings(spec, runs, launcher, parallel)
    wait = launcher == "local" if wait is None else wait
    started = now_iso()
    previous = _previous_summary(spec)
    results: dict[str, RunResult] = {}
    lock = threading.Lock()
    bar = progress_bar(len(runs), f"sweep {spec.name}", "run", requested=progress)

    def write_summary(refresh: bool = False) -> Path:
        with output_root_lock(spec.output_root):
            for name, result in list(results.items()) if refresh else ():
                if result.status in IN_FLIGHT:  # its job may have ended since: what it recorded is newer
                    results[name] = read_attempt(Path(result.run_dir)) or result
            return _write_summary(spec, runs, results, started, previous)

    def record(result: RunResult, summary: bool = True):
        with lock:
            results[result.name] = result
            if summary:
                write_summary()
            line = _log_line(result)
            append_sweep_log(spec.output_root, line)
            if result.status not in IN_FLIGHT:
                bar.update(1)
            failed = sum(1 for r in results.values() if not r.ok)
            bar.set_postfix(ok=len(results) - failed, failed=failed)
            if echo:
                bar.write(line) if not bar.disable else echo(line)

    previous_term = _stop_on_sigterm()
    try:
        jobs, left, failed, submitted = _start(spec, runs, force, launcher, parallel)
        for result in left + failed + ([] if wait else submitted):
            record(result, summary=False)  # one summary for them all: a sweep may have thousands of runs
        write_summary(refresh=True)
        if launcher == "local":
            local.run_jobs([job for _, job in jobs], parallel, record)
        elif wait:
            _follow(submitted, record)
    except KeyboardInterrupt:
        for run in runs:  # a SLURM job goes on without this command: its record says where it stands
            if run.name not in results:
                last = read_attempt(run.run_dir) if launcher == "slurm" else None
                in_flight = last is not None and last.status in IN_FLIGHT
                results[run.name] = last if in_flight else RunResult(run.name, "interrupted", str(run.run_dir))
        append_sweep_log(spec.output_root, "interrupted")
        raise
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        bar.close()
        path = write_summary(refresh=True)
    return [results[r.name] for r in runs], path


def _launch_settings(spec: SweepSpec, runs: list[RunSpec], launcher: str | None, parallel: int | None):
    """``(spec, launcher, parallel)`` as the sweep runs them: SLURM checked before anything is written; local runs
    in parallel given an even share of the cores each, unless the sweep or the environment sets OMP_NUM_THREADS."""
    launcher = launcher or spec.launcher
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher '{launcher}'; known: {list(LAUNCHERS)}")
    parallel = parallel or spec.parallel
    if launcher == "slurm":  # before anything is written
        slurm.require_slurm()
        slurm.preflight(spec, runs, parallel)
    if launcher == "local":
        parallel = parallel or 1
        if parallel > 1 and "OMP_NUM_THREADS" not in spec.env and "OMP_NUM_THREADS" not in os.environ:
            # N trainers each grabbing every core would thrash; split the cores between them.
            threads = max(1, (os.cpu_count() or 1) // parallel)
            spec = dataclasses.replace(spec, env={**spec.env, "OMP_NUM_THREADS": str(threads)})
    return spec, launcher, parallel


def _start(spec: SweepSpec, runs: list[RunSpec], force: bool, launcher: str, parallel: int | None):
    """Pick the runs to start and start them, under the output root's lock (a second sweep command then sees
    these runs' records). Returns ``(jobs, runs left alone, runs that failed to prepare, SLURM submissions)``;
    local jobs are recorded as queued here and run by the caller."""
    submitted = []
    with output_root_lock(spec.output_root, on_wait=f"waiting for another sweep command in {spec.output_root} ..."):
        start, left = _pick(spec, runs, force, Scheduler())
        append_sweep_log(
            spec.output_root, f"start {len(start)} of {len(runs)} runs, launcher={launcher}, parallel={parallel}"
        )
        jobs, failed = _prepare(spec, start, launcher)
        for result in failed:
            write_attempt(result)
        if launcher == "slurm":
            submitted = slurm.submit(spec, jobs, parallel)
        else:
            owner = this_process()  # queued until the job starts: a second sweep command leaves these alone
            for _, job in jobs:
                write_attempt(RunResult(job.name, "queued", job.run_dir, launcher="local", **owner))
    return jobs, left, failed, submitted


def _log_line(result: RunResult) -> str:
    """A run's line in the sweep log and on the console: status, name, job, why (and where its log is), time."""
    line = f"{result.status:<12} {result.name}"
    if result.job_id:
        line += f" (job {result.job_id})"
    if result.status not in ("finished", "skipped") and result.reason:
        line += f": {result.reason}"
        if result.status not in IN_FLIGHT:
            line += f" (log: {Path(result.run_dir) / TRAIN_LOG_FILENAME})"
    if result.wall_time is not None:
        line += f" [{result.wall_time:.1f}s]"
    return line


def _previous_summary(spec: SweepSpec) -> dict[str, dict]:
    return {r["name"]: r for r in read_sweep_summary(spec.output_root)}


def _write_summary(
    spec: SweepSpec, runs: list[RunSpec], results: dict[str, RunResult], started: str, previous: dict[str, dict]
) -> Path:
    # Runs left out of this invocation (--only) keep what an earlier one recorded, in the sweep's order.
    try:
        order = [r.name for r in expand(spec)]
    except (ValueError, FileNotFoundError):
        order = [r.name for r in runs]
    current = {name: dataclasses.asdict(res) for name, res in results.items()}
    merged = {**previous, **current}
    ordered = [merged[n] for n in order if n in merged] + [v for n, v in merged.items() if n not in order]
    payload = {
        "sweep": spec.name,
        "source": str(spec.source) if spec.source else None,
        "started_at": started,
        "updated_at": now_iso(),
        "counts": summary_counts(ordered),
        "runs": ordered,
    }
    return write_sweep_summary(spec.output_root, payload)


def _follow(pending: list[RunResult], on_done: Callable[[RunResult], None]) -> None:
    """Wait for SLURM jobs: a run is over when its record says so, or when its job is gone from the queue."""
    waiting = {r.name: r for r in pending}
    while waiting:
        time.sleep(WAIT_POLL_S)
        scheduler = Scheduler()
        for name, submitted in list(waiting.items()):
            record = read_attempt(Path(submitted.run_dir)) or submitted
            if record.status in IN_FLIGHT and scheduler.lookup(record) is None:
                record = read_attempt(Path(submitted.run_dir)) or record  # it may have ended just now
                if record.status in IN_FLIGHT:
                    record.status = "interrupted"
                    record.reason = f"slurm job {record.job_id} ended without recording an exit (see {record.job_log})"
            if record.status not in IN_FLIGHT:
                del waiting[name]
                on_done(record)


# ------------------------------------------------------------------------------------------ --status, --cancel


def sweep_status(spec: SweepSpec, runs: list[RunSpec] | None = None) -> list[tuple[RunSpec, RunState]]:
    """Each run's state (pending / queued / running / done / failed, with why), from its folder and the scheduler."""
    runs = expand(spec) if runs is None else runs
    scheduler = Scheduler()
    return [(run, run_state(run, read_attempt(run.run_dir), scheduler)) for run in runs]


def format_status(spec: SweepSpec, states: list[tuple[RunSpec, RunState]]) -> str:
    counts: dict[str, int] = {}
    for _, state in states:
        counts[state.status] = counts.get(state.status, 0) + 1
    order = ("done", "running", "queued", "pending", "failed")
    tally = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    lines = [f"sweep '{spec.name}': {len(states)} runs under {spec.output_root}: {tally}"]
    width = max((len(run.name) for run, _ in states), default=0)
    for run, state in states:
        detail = f"  ({state.detail})" if state.detail else ""
        lines.append(f"{state.status:<8} {run.name:<{width}}{detail}".rstrip())
    return "\n".join(lines)


def cancel_sweep(spec: SweepSpec, runs: list[RunSpec] | None = None) -> list[str]:
    """Stop every queued or running job of the sweep (scancel; SIGTERM to a local job); returns what was stopped."""
    runs = expand(spec) if runs is None else runs
    scheduler, stopped, slurm_ids = Scheduler(), [], []
    for run in runs:
        record = read_attempt(run.run_dir)
        if record is None or record.status not in IN_FLIGHT or scheduler.lookup(record) is None:
            continue
        if record.launcher == "slurm":
            slurm_ids.append(str(record.job_id))
            stopped.append(f"{run.name} (job {record.job_id})")
            if record.status == "queued":  # a job cancelled before it starts records nothing itself
                record.status, record.reason, record.finished_at = (
                    "interrupted",
                    "cancelled before it started",
                    now_iso(),
                )
                write_attempt(record)
        elif local_process_alive(record):
            os.kill(record.pid, signal.SIGTERM)
            stopped.append(f"{run.name} (pid {record.pid})")
    slurm.cancel(slurm_ids)
    return stopped
