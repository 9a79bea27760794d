"""A run folder's files, for both execution paths: their names, and every write a kill must not destroy.

`<output_dir>/metrics.jsonl` holds one JSON object per logged optimizer step (`"step"` plus the metrics of
docs/ARCHITECTURE.md). The TRL callback and the PyTRIO loop append to it with `append_jsonl_row`; a resumed run
first drops the rows logged after its checkpoint (`truncate_metrics`: those steps are trained again), so the
file ends with one row per step. Readers (`read_metrics_file`) skip and count lines that are not JSON objects.

Guarantees, each tested in tests/test_run_files.py and tests/test_kill_resume.py:

- whole-file writes (`atomic_write_text`, `write_run_config`: config.yaml, run_summary.json, eval files, loop
  state) replace the old file in one rename, so a kill leaves either the old or the new file, never half of one;
- an append after a kill mid-row never glues the new row onto the torn fragment: the fragment is dropped
  (kept, newline-terminated, if it happens to be a whole JSON object);
- `latest_checkpoint` passes over an HF `checkpoint-N` whose save was killed before its `trainer_state.json`
  (written last by `transformers.Trainer._save_checkpoint`) was complete.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from pathlib import Path

METRICS_FILENAME = "metrics.jsonl"
# Rows of `eval_*` logs of the TRL trainer's own evaluation (not optimizer steps).
EVAL_METRICS_FILENAME = "eval_metrics.jsonl"
# Greedy held-out accuracy at the start and end of a TRL recipe run ({"before": {...}, "after": {...}}).
EVAL_BEFORE_AFTER_FILENAME = "eval_before_after.json"
CONFIG_FILENAME = "config.yaml"
RUN_SUMMARY_FILENAME = "run_summary.json"
REWARD_CURVE_FILENAME = "reward_curve.png"
PYTRIO_STATE_FILENAME = "pytrio_state.json"
# HF Trainer's checkpoint folders and the file `Trainer._save_checkpoint` writes last into each.
CHECKPOINT_PATTERN = re.compile(r"checkpoint-(\d+)")
TRAINER_STATE_FILENAME = "trainer_state.json"

# Test-only: "<point>:<step>" makes `maybe_kill(point, step)` SIGKILL this process (tests/test_kill_resume.py).
TEST_KILL_ENV = "TRL_GRPO_EXT_TEST_KILL"
KILL_POINTS = ("step", "save", "metrics")


# ------------------------------------------------------------------------------------------ whole files


def atomic_write_text(path, text: str) -> None:
    """Replace `path` with `text` so a process killed mid-write leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_run_config(run_dir, config: dict) -> None:
    """`<run_dir>/config.yaml`: the run's whole config, written atomically, that `trl-grpo-ext compare` reads to
    group runs differing only in seed. Values YAML can't hold (enums, paths) are written as their `str`."""
    import yaml

    plain = json.loads(json.dumps(config, default=str))
    atomic_write_text(Path(run_dir) / CONFIG_FILENAME, yaml.safe_dump(plain, sort_keys=True))


def atomic_write_json(path, data, **dumps_kwargs) -> None:
    """`atomic_write_text` of `json.dumps(data)` plus a final newline."""
    atomic_write_text(path, json.dumps(data, **dumps_kwargs) + "\n")


# ------------------------------------------------------------------------------------------ JSONL rows


def _parse_row(line: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _repair_torn_tail(handle) -> None:
    """If the file (open 'a+b') does not end in a newline, a kill cut its last row short: drop the fragment, or
    terminate it when it is a whole JSON object (only the newline was lost), so the next row starts on its own line."""
    end = handle.seek(0, os.SEEK_END)
    if end == 0:
        return
    handle.seek(end - 1)
    if handle.read(1) == b"\n":
        return
    # Find the last newline, reading backwards in blocks: the work is bounded by the fragment's length.
    start, block = end, 1 << 16
    while start > 0:
        lo = max(0, start - block)
        handle.seek(lo)
        chunk = handle.read(start - lo)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            start = lo + cut + 1
            break
        start = lo
    handle.seek(start)
    fragment = handle.read(end - start)
    if _parse_row(fragment.decode("utf-8", errors="replace")) is not None:
        handle.seek(end)
        handle.write(b"\n")
    else:
        handle.truncate(start)
    handle.flush()


def append_jsonl_row(path, row: dict) -> None:
    """Append `row` as one JSON line to `path` (created if missing) after repairing a torn last line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(row) + "\n").encode("utf-8")
    with open(path, "a+b") as handle:  # a+: created if missing, readable; every write lands at the end
        _repair_torn_tail(handle)
        if os.environ.get(TEST_KILL_ENV) and isinstance(row.get("step"), int):
            # Test-only: half the row reaches the file, then the process dies (a kill mid-write).
            if _kill_requested("metrics", row["step"]):
                handle.write(data[: len(data) // 2])
                handle.flush()
                maybe_kill("metrics", row["step"])
        handle.write(data)
        handle.flush()


def read_metrics_file(path) -> tuple[list[dict], int]:
    """(rows, skipped) of a JSONL file such as metrics.jsonl: lines that are not JSON objects (typically the
    last line of a run killed mid-write) are skipped and counted; a missing file is ([], 0)."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    rows, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        row = _parse_row(line)
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    return rows, skipped


def run_metrics(run_dir) -> list[dict]:
    """The readable rows of `<run_dir>/metrics.jsonl`, in file order."""
    return read_metrics_file(Path(run_dir) / METRICS_FILENAME)[0]


def truncate_metrics(path, last_step: int) -> int:
    """Keep the rows up to `last_step` (0: none; a fresh run) and return how many were dropped.

    Rows without an integer step and unreadable lines go too. Called once all input is validated: it is the
    first write of a (re)started run.
    """
    path = Path(path)
    rows, skipped = read_metrics_file(path)
    kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] <= last_step]
    if kept != rows or skipped or not path.exists():
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(rows) - len(kept)


# ------------------------------------------------------------------------------------------ checkpoints


def is_complete_checkpoint(folder) -> bool:
    """Whether an HF Trainer checkpoint folder finished saving: its trainer_state.json (written after the model,
    optimizer and RNG state) exists and holds a JSON object. Weight file names vary (safetensors, adapters,
    FSDP / DeepSpeed shards), so the state file is the marker."""
    state = Path(folder) / TRAINER_STATE_FILENAME
    try:
        return isinstance(json.loads(state.read_text(encoding="utf-8")), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def latest_checkpoint(run_dir) -> Path | None:
    """Newest complete `checkpoint-N` under `run_dir` (by N), or None; a checkpoint killed while saving is passed over."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = []
    for child in run_dir.iterdir():
        match = CHECKPOINT_PATTERN.fullmatch(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    for _, child in sorted(found, reverse=True):
        if is_complete_checkpoint(child):
            return child
    return None


def resolve_resume_checkpoint(value, output_dir) -> str | None:
    """The checkpoint a TRL run resumes from: `value` is `resume_from_checkpoint` (None / 'false': none;
    True / 'true': the latest complete one under `output_dir`, none if there is none; else a folder, which must be
    a complete checkpoint). Raises ValueError with a one-line reason for an unusable folder."""
    if value is None or value is False or str(value).strip().lower() in ("", "false", "none"):
        return None
    if value is True or str(value).strip().lower() == "true":
        found = latest_checkpoint(output_dir)
        return str(found) if found is not None else None
    folder = Path(value)
    if not folder.is_dir():
        raise ValueError(f"resume_from_checkpoint: {folder} is not a folder")
    if not is_complete_checkpoint(folder):
        latest = latest_checkpoint(folder.parent)
        hint = f"; the latest complete one is {latest}" if latest else ""
        raise ValueError(
            f"resume_from_checkpoint: {folder} is incomplete (no readable {TRAINER_STATE_FILENAME}: its save was "
            f"interrupted){hint}; pass that, or 'true' for the latest complete checkpoint"
        )
    return str(folder)


# ------------------------------------------------------------------------------------------ test-only kill points


def _kill_requested(point: str, step: int) -> bool:
    spec = os.environ.get(TEST_KILL_ENV, "")
    return spec == f"{point}:{step}"


def maybe_kill(point: str, step: int) -> None:
    """SIGKILL this process when $TRL_GRPO_EXT_TEST_KILL is "<point>:<step>" (tests only; unset: a no-op)."""
    if point not in KILL_POINTS:
        raise ValueError(f"unknown kill point {point!r}; valid: {', '.join(KILL_POINTS)}")
    if _kill_requested(point, step):
        os.kill(os.getpid(), signal.SIGKILL)
