"""runs: the reader, appends after a torn line, resume truncation, atomic replacement, complete checkpoints."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trl_grpo_ext.runs import (
    METRICS_FILENAME,
    append_jsonl_row,
    atomic_write_text,
    is_complete_checkpoint,
    latest_checkpoint,
    names,
    read_metrics_file,
    resolve_resume_checkpoint,
    run_metrics,
    truncate_metrics,
)


def test_reader_skips_torn_and_non_object_lines_and_counts_them(tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_bytes(b'{"step": 1}\n[1, 2]\n\n"text"\n{"step": 2, "note": "\xff"}\n{"step": 3, "rew')
    rows, skipped = read_metrics_file(path)
    assert [r["step"] for r in rows] == [1, 2] and skipped == 3
    assert truncate_metrics(path, 1) == 1  # a list row must not break truncation
    assert run_metrics(tmp_path) == [{"step": 1}]
    assert read_metrics_file(tmp_path / "missing.jsonl") == ([], 0)


def test_append_after_a_torn_line_drops_the_fragment(tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    append_jsonl_row(path, {"step": 2, "reward": 0.5})
    assert path.read_text() == '{"step": 1}\n{"step": 2, "reward": 0.5}\n'
    assert read_metrics_file(path) == ([{"step": 1}, {"step": 2, "reward": 0.5}], 0)


def test_append_after_a_lost_newline_keeps_the_whole_row(tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_text('{"step": 1}\n{"step": 2}')  # only the newline was cut off
    append_jsonl_row(path, {"step": 3})
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics_file(path)[1] == 0


def test_append_to_a_file_that_is_one_fragment_and_to_a_missing_file(tmp_path):
    path = tmp_path / "a" / METRICS_FILENAME
    append_jsonl_row(path, {"step": 1})  # folder and file created
    path.write_text('{"ste')
    append_jsonl_row(path, {"step": 1})
    assert path.read_text() == '{"step": 1}\n'


def test_fragment_longer_than_a_read_block(tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_text('{"step": 1}\n{"step": 2, "x": "' + "y" * 200_000)
    append_jsonl_row(path, {"step": 2})
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_truncate_to_step_and_fresh_start(tmp_path):
    path = tmp_path / METRICS_FILENAME
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": "x"}\n{"st')
    assert truncate_metrics(path, 3) == 3  # steps 4, 5 and the row without an integer step
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2, 3]
    assert truncate_metrics(path, 0) == 3
    assert path.read_text() == ""
    missing = tmp_path / "new" / METRICS_FILENAME
    assert truncate_metrics(missing, 0) == 0 and missing.read_text() == ""


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    atomic_write_text(path, "old\n")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temp file left


def _checkpoint(run_dir, step, state="{}"):
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if state is not None:
        (folder / "trainer_state.json").write_text(state)
    return folder


def test_latest_checkpoint_passes_over_interrupted_saves(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, state=None)  # killed before trainer_state.json
    _checkpoint(tmp_path, 14, state='{"global_st')  # killed while writing it
    (tmp_path / "checkpoint-16").write_text("")  # not a folder
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"  # by step number, not name order
    assert is_complete_checkpoint(tmp_path / "checkpoint-2") and not is_complete_checkpoint(tmp_path / "checkpoint-12")


def test_resolve_resume_checkpoint(tmp_path):
    assert resolve_resume_checkpoint(None, tmp_path) is None
    assert resolve_resume_checkpoint("false", tmp_path) is None
    assert resolve_resume_checkpoint("true", tmp_path) is None  # nothing saved yet: a fresh start
    good = _checkpoint(tmp_path, 2)
    bad = _checkpoint(tmp_path, 4, state=None)
    assert resolve_resume_checkpoint(True, tmp_path) == str(good)
    assert resolve_resume_checkpoint("True", tmp_path) == str(good)
    assert resolve_resume_checkpoint(str(good), tmp_path) == str(good)
    with pytest.raises(ValueError, match=r"checkpoint-4 is incomplete.*latest complete one is .*checkpoint-2"):
        resolve_resume_checkpoint(str(bad), tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-9"), tmp_path)


def test_kill_points_are_inert_unless_requested(monkeypatch):
    import kill_points
    from transformers.trainer_callback import CallbackHandler

    from trl_grpo_ext.runs import metrics as metrics_file

    original = metrics_file.append_jsonl_row
    monkeypatch.delenv(kill_points.TEST_KILL_ENV, raising=False)
    assert kill_points.install(patch=monkeypatch.setattr) is None and metrics_file.append_jsonl_row is original
    assert kill_points.install("step:4", patch=monkeypatch.setattr) == ("step", 4)
    state = SimpleNamespace(global_step=3)
    handler = CallbackHandler([], None, None, None, None)
    handler.on_step_end(None, state, SimpleNamespace())  # step 3: alive
    with pytest.raises(ValueError, match="unknown kill point"):
        kill_points.install("nowhere:1", patch=monkeypatch.setattr)
    with pytest.raises(ValueError, match="step number"):
        kill_points.parse("save:x")


def test_metrics_kill_point_leaves_a_torn_row_that_the_next_append_repairs(tmp_path):
    """The run logger (both paths' writer) killed halfway through step 2's row, then the next append repairs it."""
    import kill_points

    code = (
        f"import sys; sys.path.insert(0, {str(kill_points.SCRIPT.parent)!r}); import kill_points; kill_points.install()\n"
        "from trl_grpo_ext.runs.metrics import RunLogger\n"
        "for s in (1, 2, 3): RunLogger(sys.argv[1]).log(s, {'reward': 0.25})\n"
    )
    env = {**os.environ, kill_points.TEST_KILL_ENV: "metrics:2"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, timeout=60)
    path = tmp_path / METRICS_FILENAME
    assert proc.returncode == -9, proc.stderr
    assert not path.read_text().endswith("\n") and read_metrics_file(path) == ([{"step": 1, "reward": 0.25}], 1)
    append_jsonl_row(path, {"step": 2})
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2] and read_metrics_file(path)[1] == 0


# ------------------------------------------------------------------------------------------ one place for each name

ROOT = Path(__file__).resolve().parents[1]


def _string_literals(path: Path):
    """(line, text) of every string constant of a Python file except prose: docstrings and other bare-string
    statements, and help texts (`help=...` arguments, `{"help": ...}` field metadata)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    prose |= {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "help"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            prose |= {
                id(v)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "help"
            }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node.lineno, node.value


def test_each_run_file_name_is_spelled_once_in_the_package():
    """`runs.names` is the one place a run folder's, a sweep's or an eval's file names are written: no other string
    literal of the package or the recipes holds one, help texts aside (config.json, every HF model folder's file,
    and the server storage's name, which the local PyTRIO server's default storage in the cache shares, included)."""
    values = [value for name, value in vars(names).items() if name.endswith(("_FILENAME", "_DIRNAME"))]
    values.append(f"{names.CHECKPOINT_PREFIX}-")
    assert len(values) == len(set(values)) and "metrics.jsonl" in values and "sweep_done.json" in values
    patterns = {value: re.compile(rf"(?<![\w.-]){re.escape(value)}(?![\w-])") for value in values}
    files = sorted((ROOT / "trl_grpo_ext").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))
    found = []
    for path in files:
        if path == Path(names.__file__).resolve():
            continue
        for line, text in _string_literals(path):
            found += [f"{path.relative_to(ROOT)}:{line}: {value}" for value, p in patterns.items() if p.search(text)]
    assert found == []


# ------------------------------------------------------------------------------------------ the run logger


def test_run_logger_rows_and_swanlab_mirror(tmp_path, caplog):
    """The one writer of step metrics (TRL callback and PyTRIO loop): a row per step with NaN as null, the numeric
    values mirrored to the SwanLab run, whose failures are warnings with the message redacted."""
    import logging

    import torch

    from trl_grpo_ext.runs import EVAL_METRICS_FILENAME, RunLogger

    class FakeRun:
        def __init__(self):
            self.logged, self.finished = [], 0

        def log(self, data, step=None):
            if step == 3:
                raise RuntimeError("upload refused for key SECRET")
            self.logged.append((step, data))

        def finish(self):
            self.finished += 1

    (tmp_path / METRICS_FILENAME).write_text('{"step": 1}\n{"step": 2}\n')
    run = FakeRun()
    logger = RunLogger(tmp_path, run, redact=lambda error: str(error).replace("SECRET", "***"))
    assert logger.start(1) == 1  # resumed after step 1: step 2 runs again
    row = logger.log(2, {"reward": torch.tensor(0.5), "loss": float("nan"), "note": "x"})
    assert row == {"step": 2, "reward": 0.5, "loss": None, "note": "x"}
    logger.log(5, {"eval_reward": 0.1}, EVAL_METRICS_FILENAME)  # not a step's metrics: not mirrored
    with caplog.at_level(logging.WARNING):
        logger.log(3, {"reward": 1.0})
    logger.close()
    logger.close()
    assert [r["step"] for r in run_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics_file(tmp_path / EVAL_METRICS_FILENAME)[0] == [{"step": 5, "eval_reward": 0.1}]
    assert run.logged == [(2, {"reward": 0.5})] and run.finished == 1
    assert "upload refused for key ***" in caplog.text and "SECRET" not in caplog.text
