"""Whole-file writes a kill never leaves half done, and the per-row JSONL files written that way."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from trl_grpo_ext.runs.names import CONFIG_FILENAME


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


def atomic_write_json(path, data, **dumps_kwargs) -> None:
    """`atomic_write_text` of `json.dumps(data)` plus a final newline."""
    atomic_write_text(path, json.dumps(data, **dumps_kwargs) + "\n")


def write_run_config(run_dir, config: dict) -> None:
    """`<run_dir>/config.yaml`: the run's whole config, written atomically, that `trl-grpo-ext compare` reads to
    group runs differing only in seed. Values YAML can't hold (enums, paths) are written as their `str`."""
    plain = json.loads(json.dumps(config, default=str))
    atomic_write_text(Path(run_dir) / CONFIG_FILENAME, yaml.safe_dump(plain, sort_keys=True))


def write_jsonl(path, rows) -> Path:
    """Replace `path` (atomically) with one JSON object per row."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path) -> list[dict]:
    """The rows of a JSONL file every line of which must be a JSON object (blank lines aside); ValueError naming the
    file and line otherwise. (metrics.jsonl, which a kill may leave torn, is read by `read_metrics_file`.)"""
    path = Path(path)
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: not a JSON object")
        rows.append(row)
    return rows
