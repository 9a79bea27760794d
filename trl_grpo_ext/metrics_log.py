"""`<output_dir>/metrics.jsonl`: one JSON object per logged optimizer step, written by both execution paths.

The TRL callback and the PyTRIO loop append to it; a resumed run first drops the rows logged after its
checkpoint (those steps are trained again), so the file ends with one row per step.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

METRICS_FILENAME = "metrics.jsonl"
# Greedy held-out accuracy at the start and end of a TRL recipe run ({"before": {...}, "after": {...}}).
EVAL_BEFORE_AFTER_FILENAME = "eval_before_after.json"


def atomic_write_text(path: Path, text: str) -> None:
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


def read_metrics_counting_skipped(path) -> tuple[list[dict], int]:
    """Rows of a metrics.jsonl file and how many lines were skipped as unreadable.

    A line is skipped when it is not a JSON object: typically the last line of a run killed mid-write.
    """
    path = Path(path)
    if not path.is_file():
        return [], 0
    rows, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def read_metrics(path) -> list[dict]:
    """Rows of a metrics.jsonl file; a line cut short by a kill mid-write is skipped."""
    return read_metrics_counting_skipped(path)[0]


def truncate_metrics(path, last_step: int) -> int:
    """Keep the rows up to `last_step` (0: none) and return how many were dropped."""
    path = Path(path)
    rows = read_metrics(path)
    kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] <= last_step]
    if kept != rows or not path.exists():
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(rows) - len(kept)
