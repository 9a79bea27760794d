"""`<output_dir>/metrics.jsonl`: one JSON object per logged optimizer step, written by both execution paths.

The TRL callback and the PyTRIO loop append to it; a resumed run first drops the rows logged after its
checkpoint (those steps are trained again), so the file ends with one row per step.
"""

from __future__ import annotations

import json
from pathlib import Path

from trl_grpo_ext.atomic_write import atomic_write_text

METRICS_FILENAME = "metrics.jsonl"
# Greedy held-out accuracy at the start and end of a TRL recipe run ({"before": {...}, "after": {...}}).
EVAL_BEFORE_AFTER_FILENAME = "eval_before_after.json"


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
