"""GSM8K rows (`question`, `answer` ending in `#### N`) from the hub or a local JSONL file, validated."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trl_grpo_ext.task.answers import parse_ground_truth

logger = logging.getLogger(__name__)

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
HUB_NAMES = ("gsm8k", HUB_ID)  # the sources that mean GSM8K from the hub
ON_MALFORMED = ("error", "drop")


def read_jsonl(path) -> list[dict]:
    """Rows of a JSONL dataset file; a file that is binary, not UTF-8 or not JSON lines fails naming file and line."""
    rows = []
    with open(path, "rb") as handle:
        if b"\0" in handle.read(8192):  # text never holds NUL; checked first, before a decode error hides it
            raise ValueError(f"{path}: a binary file (NUL bytes), not JSONL text")
        handle.seek(0)
        for lineno, raw in enumerate(handle, 1):
            if b"\0" in raw:
                raise ValueError(f"{path}:{lineno}: a binary file (NUL bytes), not JSONL text")
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM is not part of the row
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte {err.start} of the line); save it as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({err.msg})") from None
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows (the file is empty)")
    return rows


def load_gsm8k_rows(source: str, split: str = "train") -> list[dict]:
    """Raw rows: `source` is the hub id (`openai/gsm8k`, or `gsm8k`) or a JSONL file / a folder holding `<split>.jsonl`."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{source} has no {split}.jsonl")
    if path.suffix == ".jsonl" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"JSONL dataset file not found: {path}")
        return read_jsonl(path)
    from datasets import load_dataset

    hub_id = HUB_ID if source in HUB_NAMES else source
    config = HUB_CONFIG if hub_id == HUB_ID else None
    try:
        return [dict(row) for row in load_dataset(hub_id, config, split=split)]
    except Exception as err:  # offline or unknown id: say what to do instead of a hub stack trace
        raise FileNotFoundError(
            f"could not load {hub_id!r} split {split!r} from the hub ({type(err).__name__}: {str(err)[:200]}); "
            "pass a local JSONL of question/answer rows, or use the offline 'synthetic' source"
        ) from None


def validate_rows(rows: list[dict], on_malformed: str = "error", source: str = "dataset") -> list[dict]:
    """Keep rows with a non-empty `question` and a parseable `answer` (`#### N`, `\\boxed{}` or a bare number).

    on_malformed='error' raises naming the first bad row; 'drop' skips bad rows and logs how many.
    """
    if on_malformed not in ON_MALFORMED:
        raise ValueError(f"on_malformed must be one of {ON_MALFORMED}, got {on_malformed!r}")
    kept, dropped = [], []
    for index, row in enumerate(rows):
        problem = None
        if not isinstance(row, dict):
            problem = f"is not an object ({type(row).__name__})"
        elif not isinstance(row.get("question"), str) or not row["question"].strip():
            problem = "has no question"
        elif row.get("answer") is None or (isinstance(row["answer"], str) and not row["answer"].strip()):
            problem = "has no answer"
        elif parse_ground_truth(row["answer"]) is None:
            problem = f"has an unparseable answer {str(row['answer'])[-60:]!r}"
        if problem is None:
            kept.append({**row, "answer": str(row["answer"])})
            continue
        if on_malformed == "error":
            raise ValueError(f"{source}: row {index} {problem}; fix it or set on_malformed: drop")
        dropped.append(index)
    if dropped:
        logger.warning(
            "%s: dropped %d malformed row(s) of %d (first: row %d)", source, len(dropped), len(rows), dropped[0]
        )
    if not kept:
        raise ValueError(f"{source}: no usable rows (all {len(rows)} malformed)")
    return kept
