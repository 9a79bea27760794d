"""HF Trainer checkpoints of a run folder: the latest complete one, and the one a resume asks for.

`latest_checkpoint` passes over a `checkpoint-N` whose save was killed before its `trainer_state.json` (written
last by `transformers.Trainer._save_checkpoint`) was complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from trl_grpo_ext.runs.names import CHECKPOINT_PATTERN, TRAINER_STATE_FILENAME


def is_complete_checkpoint(folder) -> bool:
    """Whether an HF Trainer checkpoint folder finished saving: its trainer_state.json (written after the model,
    optimizer and RNG state) exists and holds a JSON object. Weight file names vary (safetensors, adapters,
    FSDP / DeepSpeed shards), so the state file is the marker."""
    state = Path(folder) / TRAINER_STATE_FILENAME
    try:
        return isinstance(json.loads(state.read_text(encoding="utf-8")), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def checkpoint_folders(run_dir) -> list[Path]:
    """The `checkpoint-N` folders under `run_dir`, newest (highest N) first, complete or not."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = CHECKPOINT_PATTERN.fullmatch(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found, reverse=True)]


def latest_checkpoint(run_dir) -> Path | None:
    """Newest complete `checkpoint-N` under `run_dir` (by N), or None; a checkpoint killed while saving is passed over."""
    return next((child for child in checkpoint_folders(run_dir) if is_complete_checkpoint(child)), None)


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
