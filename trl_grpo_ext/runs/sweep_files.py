"""A sweep's files: in each run folder the config it was given, its logs, the done marker and the eval's summary;
in the output root the summary of every run and the sweep's log."""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
from pathlib import Path

import yaml

from trl_grpo_ext.runs.checkpoints import latest_checkpoint
from trl_grpo_ext.runs.files import atomic_write_text
from trl_grpo_ext.runs.names import (
    EVAL_SUMMARY_FILENAME,
    METRICS_FILENAME,
    PYTRIO_STATE_FILENAME,
    SWEEP_ATTEMPT_FILENAME,
    SWEEP_CONFIG_FILENAME,
    SWEEP_DONE_FILENAME,
    SWEEP_JOB_FILENAME,
    SWEEP_LOCK_FILENAME,
    SWEEP_LOG_FILENAME,
    SWEEP_SUMMARY_FILENAME,
    attempt_metrics_path,
)


def now_iso() -> str:
    """UTC time to the second, as the sweep's files record it."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------ one run folder


def is_done(run_dir) -> bool:
    """Whether the sweep finished this run (its done marker is there)."""
    return (Path(run_dir) / SWEEP_DONE_FILENAME).is_file()


def read_done_marker(run_dir) -> dict:
    return json.loads((Path(run_dir) / SWEEP_DONE_FILENAME).read_text())


def write_done_marker(run_dir, marker: dict) -> None:
    """Written last, atomically, once the run's recipe exited 0."""
    atomic_write_text(Path(run_dir) / SWEEP_DONE_FILENAME, json.dumps(marker, indent=2, default=str))


def write_sweep_config(run_dir, config: dict) -> Path:
    """The exact recipe config the sweep gives this run (`--config` of its command), keys in the sweep's order."""
    path = Path(run_dir) / SWEEP_CONFIG_FILENAME
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
    return path


def has_pytrio_state(run_dir) -> bool:
    """Whether the PyTRIO loop recorded a checkpoint here (it resumes from it with `resume: true`)."""
    return (Path(run_dir) / PYTRIO_STATE_FILENAME).is_file()


def has_previous_attempt(run_dir) -> bool:
    """Whether an earlier attempt left outputs: metrics, a PyTRIO loop state or a complete TRL checkpoint."""
    run_dir = Path(run_dir)
    return (
        (run_dir / METRICS_FILENAME).is_file() or has_pytrio_state(run_dir) or latest_checkpoint(run_dir) is not None
    )


def set_aside_metrics(run_dir) -> Path | None:
    """Rename an earlier attempt's metrics.jsonl to the first free `metrics.attempt-N.jsonl` (a retry from step 0
    would otherwise interleave its rows with the old ones); returns the new path, None if there was none."""
    metrics = Path(run_dir) / METRICS_FILENAME
    if not metrics.is_file():
        return None
    n = 1
    while attempt_metrics_path(run_dir, n).exists():
        n += 1
    return metrics.rename(attempt_metrics_path(run_dir, n))


def read_eval_summary(run_dir) -> dict | None:
    """The `summary` of the sweep's eval of this run (`eval_summary.json`), None when there is none; ValueError
    when the file is unreadable."""
    path = Path(run_dir) / EVAL_SUMMARY_FILENAME
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text()).get("summary")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"unreadable {EVAL_SUMMARY_FILENAME}") from None
    return summary if isinstance(summary, dict) else {}


def write_job_description(run_dir, job: dict) -> None:
    """`sweep_job.json`: what the run's job needs to train it (launch/job.py), written before it is started."""
    atomic_write_text(Path(run_dir) / SWEEP_JOB_FILENAME, json.dumps(job, indent=2, default=str))


def read_job_description(run_dir) -> dict:
    return json.loads((Path(run_dir) / SWEEP_JOB_FILENAME).read_text())


def write_attempt_record(run_dir, record: dict) -> None:
    """`sweep_attempt.json`: what the run's last job did or is doing (launch/records.py), replaced whole."""
    atomic_write_text(Path(run_dir) / SWEEP_ATTEMPT_FILENAME, json.dumps(record, indent=2, default=str))


def read_attempt_record(run_dir) -> dict | None:
    """The last attempt record, None when there is none or it is unreadable."""
    try:
        record = json.loads((Path(run_dir) / SWEEP_ATTEMPT_FILENAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# ------------------------------------------------------------------------------------------ the output root


@contextlib.contextmanager
def output_root_lock(root, on_wait: str | None = None):
    """`<root>/.sweep.lock`, held while a sweep command picks and starts runs or the summary is rewritten, so two
    commands (or a command and a job) never act on the same run at once. Prints `on_wait` if it must wait."""
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / SWEEP_LOCK_FILENAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                print(on_wait, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def summary_counts(entries: list[dict]) -> dict[str, int]:
    """How many runs of a summary are in each status."""
    return {s: sum(1 for r in entries if r["status"] == s) for s in sorted({r["status"] for r in entries})}


def update_sweep_summary_entry(root, entry: dict) -> None:
    """Put one run's entry (by name) into `<root>/sweep_summary.json`, under the root's lock; no summary, no
    change (the sweep command writes one, with every record it finds, when it starts runs)."""
    with output_root_lock(root):
        path = Path(root) / SWEEP_SUMMARY_FILENAME
        try:
            payload = json.loads(path.read_text())
            entries = payload["runs"]
            names = [e.get("name") for e in entries]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if entry["name"] in names:
            entries[names.index(entry["name"])] = entry
        else:
            entries.append(entry)
        payload.update(updated_at=now_iso(), counts=summary_counts(entries), runs=entries)
        write_sweep_summary(root, payload)


def read_sweep_summary(root) -> list[dict]:
    """The run entries of `<root>/sweep_summary.json` in the sweep's order; [] when absent or unreadable."""
    try:
        runs = json.loads((Path(root) / SWEEP_SUMMARY_FILENAME).read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [r for r in runs if isinstance(r, dict) and "name" in r] if isinstance(runs, list) else []


def write_sweep_summary(root, payload: dict) -> Path:
    path = Path(root) / SWEEP_SUMMARY_FILENAME
    atomic_write_text(path, json.dumps(payload, indent=2, default=str))
    return path


def append_sweep_log(root, line: str) -> None:
    with open(Path(root) / SWEEP_LOG_FILENAME, "a") as handle:
        handle.write(f"{now_iso()} {line}\n")
