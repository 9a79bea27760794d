"""Reading finished run folders for `trl-grpo-ext compare`: which folders are runs, each run's config, backend and
held-out figures. A folder written by either recipe, by hand or by a sweep, reads the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from trl_grpo_ext.runs.checkpoints import checkpoint_folders
from trl_grpo_ext.runs.files import yaml_loads
from trl_grpo_ext.runs.names import (
    CONFIG_FILENAME,
    EVAL_BEFORE_AFTER_FILENAME,
    METRICS_FILENAME,
    PYTRIO_STATE_FILENAME,
    SWEEP_CONFIG_FILENAME,
    SWEEP_DONE_FILENAME,
)
from trl_grpo_ext.runs.sweep_files import read_sweep_summary

# Where a run's config lies, best first: the sweep's marker (it holds the config) and the config the sweep gave the
# run, then the one both recipes save (`write_run_config`).
CONFIG_CANDIDATES = (SWEEP_DONE_FILENAME, SWEEP_CONFIG_FILENAME, CONFIG_FILENAME)


def is_number(value) -> bool:
    """A finite int or float (not a bool): a value a metric or summary can be computed from."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_run_config(run_dir) -> tuple[dict, str | None, dict | None]:
    """(config, file it came from, sweep marker if any) for a run folder; ({}, None, marker) when none is found."""
    run_dir = Path(run_dir)
    marker = None
    for name in CONFIG_CANDIDATES:
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            data = yaml_loads(path.read_text()) if path.suffix == ".yaml" else json.loads(path.read_text())
        except (yaml.YAMLError, json.JSONDecodeError, OSError):
            continue
        if not isinstance(data, dict):
            continue
        if name == SWEEP_DONE_FILENAME:
            marker = data
            if isinstance(data.get("config"), dict):
                return data["config"], name, marker
            continue
        return data, name, marker
    return {}, None, marker


def run_backend(run_dir, config: dict, marker: dict | None) -> str | None:
    """'trl' or 'pytrio': as the sweep or the saved config says, else from the files each backend leaves behind."""
    backend = (marker or {}).get("backend") or config.get("backend")
    if backend is not None:
        return backend
    run_dir = Path(run_dir)
    if (run_dir / PYTRIO_STATE_FILENAME).is_file() or "pytrio_base_url" in config:
        return "pytrio"
    if checkpoint_folders(run_dir) or "model_name_or_path" in config:
        return "trl"
    return None


def looks_like_run(path) -> bool:
    path = Path(path)
    return (path / METRICS_FILENAME).is_file() or any((path / name).is_file() for name in CONFIG_CANDIDATES)


def run_folders(paths) -> list[Path]:
    """Run folders from the arguments; a sweep's output root stands for all the runs under it (in the sweep's order)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise FileNotFoundError(f"run folder not found: {path}")
        if looks_like_run(path):
            out.append(path)
            continue
        children = _sweep_children(path)
        if not children:
            raise FileNotFoundError(f"{path} holds no {METRICS_FILENAME} or saved config, and no run folders under it")
        out.extend(children)
    return out


def _sweep_children(root: Path) -> list[Path]:
    children = [c for c in root.iterdir() if c.is_dir() and looks_like_run(c)]
    order = {entry["name"]: i for i, entry in enumerate(read_sweep_summary(root))}
    return sorted(children, key=lambda c: (order.get(c.name, len(order)), c.name))


def read_heldout_accuracy(run_dir, notes: list[str]) -> dict:
    """{'before', 'after': boxed accuracy, 'before_any_format', 'after_any_format': format-independent accuracy,
    'n': problems} from the recipe's eval_before_after.json (what it holds of these); {} when absent. An unreadable
    file adds a line to `notes`."""
    path = Path(run_dir) / EVAL_BEFORE_AFTER_FILENAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        notes.append(f"unreadable {path.name}")
        return {}
    out = {}
    for when in ("before", "after"):
        entry = data.get(when)
        if isinstance(entry, dict) and is_number(entry.get("accuracy")):
            out[when] = float(entry["accuracy"])
            if is_number(entry.get("accuracy_any_format")):
                out[f"{when}_any_format"] = float(entry["accuracy_any_format"])
            if is_number(entry.get("n")):
                out["n"] = int(entry["n"])
    return out
