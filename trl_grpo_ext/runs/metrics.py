"""`metrics.jsonl`: one JSON object per logged optimizer step, appended by both execution paths.

A resumed run first drops the rows logged after its checkpoint (`truncate_metrics`: those steps are trained again),
so the file ends with one row per step. An append after a kill mid-row never glues the new row onto the torn
fragment: the fragment is dropped (kept, newline-terminated, if it happens to be a whole JSON object). Readers
(`read_metrics_file`) skip and count lines that are not JSON objects.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from trl_grpo_ext.runs.files import atomic_write_text
from trl_grpo_ext.runs.names import METRICS_FILENAME
from trl_grpo_ext.runs.tracking import jsonable

logger = logging.getLogger(__name__)


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
    """Append `row` as one JSON line to `path` (created if missing) after repairing a torn last line.

    The row is written whole or not at all: a write that fails partway (a full disk, a file-size limit) is cut back
    to where the row began before the error is raised, so the file never ends in a partial row.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(row) + "\n").encode("utf-8")
    # unbuffered: each write reaches the file at once, so a failing one is seen here, with the row's start known
    with open(path, "a+b", buffering=0) as handle:  # a+: created if missing, readable; every write lands at the end
        _repair_torn_tail(handle)
        start = handle.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                written = handle.write(view)
                view = view[written:]
        except BaseException:
            try:
                handle.truncate(start)  # frees what the partial row took; works on a full disk
            except OSError:
                logger.warning("could not remove a partial row at the end of %s", path)
            raise


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


class RunLogger:
    """The one writer of a run's step metrics, for both execution paths: one `metrics.jsonl` row per logged step
    (`"step"` plus the metrics, NaN as null), mirrored to a started SwanLab run (`tracking.start_swanlab`) if given.

    The TRL path passes none (transformers' own SwanLab callback logs there); the PyTRIO loop passes its run.
    `redact` cleans the messages of SwanLab failures, which are warnings: tracking never stops a training run.
    """

    def __init__(self, output_dir, swanlab=None, redact=str):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILENAME
        self._swanlab = swanlab
        self._redact = redact

    def start(self, resumed_step: int = 0) -> int:
        """A fresh run (step 0) starts an empty file; a resumed one keeps its rows up to its checkpoint's step. Returns
        how many rows were dropped."""
        return truncate_metrics(self.path, resumed_step)

    def log(self, step: int, metrics: dict, filename: str = METRICS_FILENAME) -> dict:
        """Append `{"step": step, **metrics}` to `filename` in the run folder (a torn last line is repaired first)."""
        row = {"step": int(step)}
        row.update({key: jsonable(value) for key, value in metrics.items()})
        append_jsonl_row(self.output_dir / filename, row)
        if self._swanlab is not None and filename == METRICS_FILENAME:
            numeric = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            try:
                self._swanlab.log(numeric, step=int(step))
            except Exception as error:  # noqa: BLE001 - tracking must not stop a training run
                logger.warning("SwanLab log failed at step %d: %s", step, self._redact(error))
        return row

    def close(self) -> None:
        if self._swanlab is not None:
            try:
                self._swanlab.finish()
            except Exception as error:  # noqa: BLE001
                logger.warning("SwanLab finish failed: %s", self._redact(error))
            self._swanlab = None
