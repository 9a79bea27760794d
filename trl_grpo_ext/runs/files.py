"""Whole-file writes a kill never leaves half done, the per-row JSONL files written that way, and the one YAML
reader of recipes, sweep files and run configs (`load_yaml`)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import yaml

from trl_grpo_ext.runs.names import CONFIG_FILENAME


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads an unquoted `4e-5` (no dot: a string to YAML 1.1) as the number it is
    in YAML 1.2 and in Python; a quoted '4e-5' stays a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def yaml_loads(text: str):
    """`text` read as YAML with `load_yaml`'s rules (a sweep's `--set key=value` values)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path) -> dict:
    """The mapping a YAML file holds (empty file: {}); ValueError / FileNotFoundError naming the file, in one line.

    The one reader of recipes (`trl_grpo_ext.trl.script_args.parse_recipe_args`, both paths) and sweep files
    (`trl_grpo_ext.experiments.sweep`): `4e-5` is a number in both."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"YAML file not found: {path}")
    try:
        data = yaml_loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}); a YAML file is expected") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{path} is not valid YAML{at}: {getattr(err, 'problem', None) or err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping of option: value, got {type(data).__name__}")
    return data


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
