"""The SLURM launcher: a sweep's runs as job arrays (sbatch), followed with squeue, stopped with scancel.

Runs asking for the same resources share one array (a TRL grid is one array; PyTRIO runs, which need no GPU, make
another); each array task runs the sweep's job for one run folder (`launch/job.py`). Everything lands under
`<output_root>/slurm_jobs/`: the sbatch script and its run list as submitted, and each task's own output `<A>_<a>.out`.
State is read from squeue and the run folders only: no job accounting (sacct / slurmdbd) is needed.
"""

from __future__ import annotations

import datetime as _dt
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trl_grpo_ext.experiments.launch import LauncherError
from trl_grpo_ext.experiments.launch.commands import PACKAGE_ROOT, build_command
from trl_grpo_ext.experiments.launch.job import Job
from trl_grpo_ext.experiments.launch.records import RunResult, RunState, write_attempt
from trl_grpo_ext.experiments.sweep import RunSpec, SweepSpec
from trl_grpo_ext.runs.names import slurm_array_files, slurm_task_output

# squeue states of a job that has not started (or waits to start again); every other listed state is running.
QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
MAX_ARRAY_TASKS = 1000  # SLURM's default MaxArraySize is 1001 (indices 0..1000)


def require_slurm() -> None:
    """Refuse, in one line, where SLURM's commands are missing (before anything is written)."""
    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise LauncherError(
            f"--launcher slurm needs SLURM's sbatch and squeue on PATH ({', '.join(missing)} not found): run the "
            "sweep on a SLURM login node (or load its module), or use --launcher local"
        )


def _slurm(cmd: list[str], what: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LauncherError(f"{what}: {cmd[0]} failed: {e}") from None
    if done.returncode != 0:
        message = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
        raise LauncherError(f"{what}: {message}")
    return done.stdout


class SlurmQueue:
    """This user's jobs as squeue lists them now (array tasks one by one), read once on first use."""

    def __init__(self):
        self._jobs: dict[str, tuple[str, str, str]] | None = None
        self._error: LauncherError | None = None

    def jobs(self) -> dict[str, tuple[str, str, str]]:
        """job id -> (state, reason, nodes); a failed squeue raises LauncherError (once asked, never again)."""
        if self._error is not None:
            raise self._error
        if self._jobs is None:
            user = pwd.getpwuid(os.getuid()).pw_name
            try:
                out = _slurm(
                    ["squeue", "--noheader", "--array", f"--user={user}", "--format=%i|%T|%r|%N"],
                    "cannot read the SLURM queue (squeue)",
                )
            except LauncherError as e:
                self._error = e
                raise
            self._jobs = {}
            for line in out.splitlines():
                parts = line.strip().split("|")
                if len(parts) == 4:
                    self._jobs[parts[0]] = (parts[1], parts[2], parts[3])
        return self._jobs

    def lookup(self, record: RunResult) -> RunState | None:
        listed = self.jobs().get(str(record.job_id))
        if listed is None:
            return None
        state, reason, nodes = listed
        if state in QUEUED_STATES:
            return RunState("queued", f"job {record.job_id}" + (f": {reason}" if reason not in ("", "None") else ""))
        return RunState("running", f"job {record.job_id}" + (f" on {nodes}" if nodes else ""))


@dataclass(frozen=True)
class Resources:
    """What one run's job asks SLURM for; runs with equal resources share a job array."""

    gpus: int
    cpus: int | None
    mem: str | None
    time: str | None
    partition: str | None
    account: str | None
    qos: str | None
    extra: tuple[str, ...] = ()

    def sbatch_options(self) -> list[str]:
        options = ["--nodes=1", "--ntasks=1"]
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--cpus-per-task", self.cpus),
            ("--mem", self.mem),
            ("--time", self.time),
        ):
            if value is not None:
                options.append(f"{flag}={value}")
        if self.gpus:
            options.append(f"--gres=gpu:{self.gpus}")
        return options + list(self.extra)


def run_gpus(spec: SweepSpec, run: RunSpec) -> int:
    """GPUs a run's job asks for: none for PyTRIO (the model runs behind its server), else `gpus_per_run`, by
    default 1 (0 when the run's config says use_cpu)."""
    if run.backend == "pytrio":
        return 0
    if spec.slurm.gpus_per_run is not None:
        return spec.slurm.gpus_per_run
    return 0 if run.config.get("use_cpu") else 1


def resources(spec: SweepSpec, run: RunSpec) -> Resources:
    o = spec.slurm
    return Resources(
        run_gpus(spec, run), o.cpus_per_run, o.mem, o.time, o.partition, o.account, o.qos, tuple(o.extra_sbatch_args)
    )


def job_script(spec: SweepSpec, res: Resources, run_list: Path, count: int, parallel: int | None) -> str:
    """The sbatch script of one array: a task per line of `run_list`, each running the sweep's job for that run."""
    throttle = f"%{parallel}" if parallel else ""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={spec.name}", f"#SBATCH --array=0-{count - 1}{throttle}"]
    lines += [f"#SBATCH --output={slurm_task_output(spec.output_root, '%A_%a')}", "#SBATCH --open-mode=append"]
    lines += [f"#SBATCH {option}" for option in res.sbatch_options()]
    source = f" {spec.source}" if spec.source else ""
    lines += [
        f"# Written by `trl-grpo-ext sweep{source} --launcher slurm`: task I runs the sweep's job for line I+1 of",
        f"# {run_list}; the job resumes from the run's last complete checkpoint and records how it ended there.",
        f"cd {shlex.quote(str(Path.cwd()))}",
        f'export PYTHONPATH={shlex.quote(PACKAGE_ROOT)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        f"exec {shlex.quote(sys.executable)} -m trl_grpo_ext.experiments.launch.job --list {shlex.quote(str(run_list))} "
        '--index "$SLURM_ARRAY_TASK_ID"',
    ]
    return "\n".join(lines) + "\n"


def _new_array_files(spec: SweepSpec) -> tuple[Path, Path]:
    """(sbatch script, run list) paths for the next array, unused so far (the caller holds the root's lock)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 0
    while (paths := slurm_array_files(spec.output_root, f"{spec.name}-{stamp}-{n}"))[0].exists():
        n += 1
    return paths


def plan(spec: SweepSpec, jobs: list[tuple[RunSpec, Job | None]]) -> list[tuple[Resources, list]]:
    """(run, job) pairs grouped into arrays: equal resources together, in sweep order, at most MAX_ARRAY_TASKS each."""
    groups: dict[Resources, list] = {}
    for run, job in jobs:
        groups.setdefault(resources(spec, run), []).append((run, job))
    return [
        (res, members[i : i + MAX_ARRAY_TASKS])
        for res, members in groups.items()
        for i in range(0, len(members), MAX_ARRAY_TASKS)
    ]


def describe(spec: SweepSpec, runs: list[RunSpec], parallel: int | None) -> str:
    """The `--dry-run` view of a SLURM submission: the arrays and what each of their tasks asks for."""
    lines = []
    for i, (res, members) in enumerate(plan(spec, [(run, None) for run in runs]), 1):
        throttle = f", at most {parallel} at once" if parallel else ""
        lines.append(f"job array {i}: {len(members)} runs{throttle}: sbatch {' '.join(res.sbatch_options())}")
        try:
            command = build_command(spec, members[0][0], num_processes=max(1, res.gpus), resume=False)
            lines.append(f"      its tasks train with, e.g.: {' '.join(command)}")
        except (FileNotFoundError, ValueError) as e:
            lines.append(f"      <cannot build command: {e}>")
    return "\n".join(lines)


def preflight(spec: SweepSpec, runs: list[RunSpec], parallel: int | None) -> None:
    """Ask SLURM (`sbatch --test-only`) whether it would take each array, before anything is written: a wrong
    partition, account or GPU request is one line now, not a folder of half-prepared runs."""
    for res, members in plan(spec, [(run, None) for run in runs]):
        throttle = f"%{parallel}" if parallel else ""
        options = [f"--array=0-{len(members) - 1}{throttle}", *res.sbatch_options()]
        _slurm(["sbatch", "--test-only", *options, "--wrap", "true"], f"SLURM refuses `sbatch {' '.join(options)}`")


def submit(spec: SweepSpec, jobs: list[tuple[RunSpec, Job]], parallel: int | None) -> list[RunResult]:
    """sbatch one array per resource group; each run's record becomes `queued` with its task's job id."""
    records = []
    for res, members in plan(spec, jobs):
        script, run_list = _new_array_files(spec)
        script.parent.mkdir(parents=True, exist_ok=True)
        run_list.write_text("".join(f"{job.run_dir}\n" for _, job in members))
        script.write_text(job_script(spec, res, run_list, len(members), parallel))
        out = _slurm(["sbatch", "--parsable", str(script)], f"sbatch refused {script}")
        array_id = out.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"
        if not array_id.isdigit():
            raise LauncherError(f"sbatch printed no job id for {script}: {out.strip()!r}")
        for index, (_, job) in enumerate(members):
            job_id = f"{array_id}_{index}"
            record = RunResult(job.name, "queued", job.run_dir, launcher="slurm", job_id=job_id)
            record.job_log = str(slurm_task_output(spec.output_root, job_id))
            write_attempt(record)
            records.append(record)
    return records


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        _slurm(["scancel", *job_ids], "scancel failed")
