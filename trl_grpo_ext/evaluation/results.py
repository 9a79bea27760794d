"""Per-problem results on disk: one JSON object per problem (`ProblemResult`), written atomically."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from trl_grpo_ext.evaluation.scoring import ProblemResult
from trl_grpo_ext.runs import read_jsonl, write_jsonl


def write_results(path: str | os.PathLike, results: Sequence[ProblemResult]) -> Path:
    return write_jsonl(path, (asdict(r) for r in results))


def read_results(path: str | os.PathLike) -> list[ProblemResult]:
    """Per-problem results written by `write_results`; ValueError naming the file when one is unreadable."""
    out = []
    for number, row in enumerate(read_jsonl(path), 1):
        try:
            out.append(ProblemResult.from_dict(row))
        except TypeError as err:
            raise ValueError(f"{path}: row {number}: not a per-problem result ({err})") from None
    return out
