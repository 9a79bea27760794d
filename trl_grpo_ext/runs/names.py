"""Every file and folder name of a run folder (`output_dir`), of a sweep's output root, and of `trl-grpo-ext eval`'s
outputs. Nothing else in the package spells one of these names (tests/test_runs.py checks it)."""

from __future__ import annotations

import re
from pathlib import Path

# ------------------------------------------------------------------------------------------ a run folder

# One JSON object per logged optimizer step ("step" plus the metrics of docs/ARCHITECTURE.md), both paths.
METRICS_FILENAME = "metrics.jsonl"
# Rows of `eval_*` logs of the TRL trainer's own evaluation (not optimizer steps).
EVAL_METRICS_FILENAME = "eval_metrics.jsonl"
# The run's whole config as it ran (`write_run_config`), both paths; `trl-grpo-ext compare` groups runs by it.
CONFIG_FILENAME = "config.yaml"
# Rewards first vs last, the before/after eval, wall time, peak memory (`recipe.report_run`).
RUN_SUMMARY_FILENAME = "run_summary.json"
REWARD_CURVE_FILENAME = "reward_curve.png"
# Greedy held-out accuracy at the start and end of a TRL recipe run ({"before": {...}, "after": {...}}), and the
# per-problem results of each of the two evals beside it.
EVAL_BEFORE_AFTER_FILENAME = "eval_before_after.json"
EVAL_BEFORE_PROBLEMS_FILENAME = "eval_before.jsonl"
EVAL_AFTER_PROBLEMS_FILENAME = "eval_after.jsonl"
# SwanLab's offline logs.
SWANLAB_DIRNAME = "swanlog"
# The PyTRIO loop's resume record, and the local PyTRIO server's checkpoint storage beside it (also the name of
# the server's default storage in the package cache, `trl_grpo_ext.pytrio_server.config.default_storage_dir`).
PYTRIO_STATE_FILENAME = "pytrio_state.json"
PYTRIO_SERVER_DIRNAME = "pytrio-server"
# HF Trainer's checkpoint folders (`transformers.trainer_utils.PREFIX_CHECKPOINT_DIR`), the file
# `Trainer._save_checkpoint` writes last into each, and the curriculum's pass rates saved beside it.
CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_PATTERN = re.compile(rf"{CHECKPOINT_PREFIX}-(\d+)")
TRAINER_STATE_FILENAME = "trainer_state.json"
CURRICULUM_STATE_FILENAME = "curriculum_state.json"
# An asynchronous run's batches already drawn for the steps after a checkpoint (`trl_grpo_ext.trl.async_sampling`)
ASYNC_ROLLOUTS_FILENAME = "async_rollouts.json"
# A model saved into the run folder (`save_model`): a LoRA adapter's config (peft), else the model's config
# (transformers; every model folder has one: `trl_grpo_ext.models` checks model folders by it too).
ADAPTER_CONFIG_FILENAME = "adapter_config.json"
MODEL_CONFIG_FILENAME = "config.json"

# ------------------------------------------------------------------------------------------ a sweep

# In each run folder: the recipe config the sweep gave it, the recipe's and the eval's output, the eval's results,
# and (written last, on success) the marker that the run is done.
SWEEP_CONFIG_FILENAME = "sweep_config.yaml"
TRAIN_LOG_FILENAME = "train.log"
EVAL_LOG_FILENAME = "eval.log"
EVAL_RESULTS_FILENAME = "eval.jsonl"
SWEEP_DONE_FILENAME = "sweep_done.json"
# In the sweep's output root: every run's status, and one line per finished run.
SWEEP_SUMMARY_FILENAME = "sweep_summary.json"
SWEEP_LOG_FILENAME = "sweep.log"
# In each run folder: the job that trains it (written by the sweep's launcher) and what its last job did or is
# doing: queued, running, finished, failed, interrupted (trl_grpo_ext/experiments/launch/).
SWEEP_JOB_FILENAME = "sweep_job.json"
SWEEP_ATTEMPT_FILENAME = "sweep_attempt.json"
# In the sweep's output root: the lock a sweep command holds while it picks and starts runs, and the SLURM
# launcher's folder (each submitted array's sbatch script and run list, each array task's own output).
SWEEP_LOCK_FILENAME = ".sweep.lock"
SLURM_JOBS_DIRNAME = "slurm_jobs"


def checkpoint_dir(output_dir, step: int) -> Path:
    """`<output_dir>/checkpoint-<step>`."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}-{step}"


def attempt_metrics_path(run_dir, attempt: int) -> Path:
    """`<run_dir>/metrics.attempt-<attempt>.jsonl`: an earlier attempt's metrics, set aside by a sweep retry."""
    metrics = Path(METRICS_FILENAME)
    return Path(run_dir) / f"{metrics.stem}.attempt-{attempt}{metrics.suffix}"


def slurm_array_files(root, stem: str) -> tuple[Path, Path]:
    """(sbatch script, run list) of one submitted job array: `<root>/slurm_jobs/<stem>.sbatch` and `<stem>.runs`."""
    folder = Path(root) / SLURM_JOBS_DIRNAME
    return folder / f"{stem}.sbatch", folder / f"{stem}.runs"


def slurm_task_output(root, job_id: str) -> Path:
    """An array task's own output, `<root>/slurm_jobs/<array job>_<task>.out` (job_id "%A_%a": sbatch's pattern)."""
    return Path(root) / SLURM_JOBS_DIRNAME / f"{job_id}.out"


# ------------------------------------------------------------------------------------------ eval outputs


def eval_summary_path(results) -> Path:
    """The summary beside `trl-grpo-ext eval`'s per-problem results: `eval.jsonl` -> `eval_summary.json`."""
    results = Path(results)
    return results.with_name(f"{results.stem}_summary.json")


def eval_compare_path(results) -> Path:
    """The `--compare_model`'s per-problem results beside the model's: `eval.jsonl` -> `eval_compare.jsonl`."""
    results = Path(results)
    return results.with_name(f"{results.stem}_compare{results.suffix or '.jsonl'}")


EVAL_SUMMARY_FILENAME = eval_summary_path(EVAL_RESULTS_FILENAME).name  # what a sweep's eval writes
