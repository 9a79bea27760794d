"""A sweep's runs as commands and processes: the train and eval commands of a run, its environment, its status
from its folder, and the tail of its logs; used by the local and SLURM launchers, `--dry-run` and the jobs."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from trl_grpo_ext.evaluation import EMBEDDED_DATA, eval_cli_args
from trl_grpo_ext.experiments.sweep import BACKENDS, RunSpec, SweepSpec, backend_of
from trl_grpo_ext.runs import (
    ADAPTER_CONFIG_FILENAME,
    EVAL_RESULTS_FILENAME,
    MODEL_CONFIG_FILENAME,
    SWEEP_CONFIG_FILENAME,
    latest_checkpoint,
)
from trl_grpo_ext.runs.sweep_files import has_previous_attempt, is_done

LOG_TAIL_LINES = 40
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # a job's PYTHONPATH: this copy, installed or not


# -------------------------------------------------------------------------------------------- running


def run_status(run: RunSpec) -> str:
    """`done` (marker present), `resume` (a previous attempt left outputs) or `new`."""
    if is_done(run.run_dir):
        return "done"
    if has_previous_attempt(run.run_dir):
        return "resume"
    return "new"


def resolve_script(script: str, source: Path | None) -> Path:
    """Find a recipe script: as given, next to the sweep file's folders, or in this repository's checkout."""
    p = Path(script)
    if p.is_absolute():
        return p
    candidates = [Path.cwd() / p]
    if source is not None:
        candidates += [parent / p for parent in source.parents]
    candidates.append(Path(PACKAGE_ROOT) / p)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(f"recipe script '{script}' not found (looked in {[str(c.parent) for c in candidates]})")


def build_command(spec: SweepSpec, run: RunSpec, num_processes: int | None = None, resume: bool = True) -> list[str]:
    """The command that trains `run`: its backend's recipe script on its sweep_config.yaml, through `accelerate
    launch` when the sweep asks for it (`accelerate_config`) or runs more than one process (`num_processes`, or a
    SLURM run's GPUs, which win), plus the flags that resume it from its folder's last complete checkpoint
    (`resume`; a job adds them when it starts)."""
    backend = backend_of(spec, run.backend)
    if not backend.script:
        raise ValueError(f"backend '{run.backend}' has no script; set 'scripts: {{{run.backend}: path}}'")
    script = str(resolve_script(backend.script, spec.source))
    processes = num_processes or spec.num_processes
    if spec.use_accelerate or (processes or 1) > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch"]
        if spec.accelerate_config:
            cmd += ["--config_file", spec.accelerate_config]
        if processes:
            cmd += ["--num_processes", str(processes)]
        cmd.append(script)
    else:
        cmd = [sys.executable, script]
    cmd += ["--config", str(run.run_dir / SWEEP_CONFIG_FILENAME)]
    if resume:
        cmd += resume_args(run.backend, run.run_dir)
    return cmd


def resume_args(backend: str, run_dir: Path) -> list[str]:
    """The flags that resume a run of `backend` from what its folder holds now (none for a custom backend)."""
    known = BACKENDS.get(backend)
    return known.resume_args(run_dir) if known else []


def run_env(extra: Mapping[str, str], sweep: str, run_name: str) -> dict:
    """The environment of a run's processes: this process's, plus the sweep file's `env:` (`extra`) and names."""
    env = dict(os.environ)
    env.update(extra)
    # SwanLab reads these when the recipe calls swanlab.init without naming them; a user's own values win.
    env.setdefault("SWANLAB_GROUP", sweep)
    env["SWANLAB_EXP_NAME"] = run_name
    env["TRL_GRPO_EXT_SWEEP"] = sweep
    env["TRL_GRPO_EXT_RUN_NAME"] = run_name
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Recipes and `eval` import trl_grpo_ext: make it the same copy as this one, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def eval_command(run: RunSpec, options: dict) -> list[str]:
    """`trl-grpo-ext eval` on a finished run's model (its saved adapter over the base model when it has one)."""
    run_dir = run.run_dir
    if (run_dir / ADAPTER_CONFIG_FILENAME).is_file():
        base = run.config.get("model_name_or_path")
        if not base:
            raise ValueError(f"{run_dir} holds a LoRA adapter but the config names no 'model_name_or_path'")
        model_args = ["--model", str(base), "--adapter", str(run_dir)]
    elif (run_dir / MODEL_CONFIG_FILENAME).is_file():
        model_args = ["--model", str(run_dir)]
    elif (ckpt := latest_checkpoint(run_dir)) is not None:
        model_args = ["--model", str(ckpt)]
    else:
        raise FileNotFoundError(f"{run_dir} holds no saved model (no {MODEL_CONFIG_FILENAME}, adapter or checkpoint)")
    cmd = [sys.executable, "-m", "trl_grpo_ext.cli", "eval"]
    cmd += model_args
    cmd += eval_cli_args(options)
    if (
        options.get("data", EMBEDDED_DATA) == EMBEDDED_DATA
        and "tasks" not in options
        and run.config.get("synthetic_tasks")
    ):
        cmd += ["--tasks", str(run.config["synthetic_tasks"])]  # evaluate on the task mix it trained on
    cmd += ["--out", str(run_dir / EVAL_RESULTS_FILENAME)]
    return cmd


def describe_runs(spec: SweepSpec, runs: list[RunSpec]) -> str:
    """The `--dry-run` listing: one line per run with its status, folder and command."""
    lines = [f"sweep '{spec.name}': {len(runs)} runs under {spec.output_root}"]
    for i, run in enumerate(runs, 1):
        status = run_status(run)
        try:
            cmd = " ".join(build_command(spec, run))
        except (FileNotFoundError, ValueError) as e:
            cmd = f"<cannot build command: {e}>"
        lines.append(f"[{i:>3}] {status:<6} {run.backend:<7} {run.name}")
        lines.append(f"      dir: {run.run_dir}")
        lines.append(f"      cmd: {cmd}")
    return "\n".join(lines)
