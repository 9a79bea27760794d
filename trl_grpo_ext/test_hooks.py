"""Test-only kill points: $TRL_GRPO_EXT_TEST_KILL="<point>:<step>" makes `maybe_kill(point, step)` SIGKILL this
process (tests/test_kill_resume.py); unset, every hook is a no-op."""

from __future__ import annotations

import os
import signal

TEST_KILL_ENV = "TRL_GRPO_EXT_TEST_KILL"
KILL_POINTS = ("step", "save", "metrics")


def _kill_requested(point: str, step: int) -> bool:
    spec = os.environ.get(TEST_KILL_ENV, "")
    return spec == f"{point}:{step}"


def maybe_kill(point: str, step: int) -> None:
    """SIGKILL this process when $TRL_GRPO_EXT_TEST_KILL is "<point>:<step>" (tests only; unset: a no-op)."""
    if point not in KILL_POINTS:
        raise ValueError(f"unknown kill point {point!r}; valid: {', '.join(KILL_POINTS)}")
    if _kill_requested(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_tear_row(handle, data: bytes, row: dict) -> None:
    """The "metrics" point: half the row reaches the file, then the process dies (a kill mid-write)."""
    if os.environ.get(TEST_KILL_ENV) and isinstance(row.get("step"), int) and _kill_requested("metrics", row["step"]):
        handle.write(data[: len(data) // 2])
        handle.flush()
        maybe_kill("metrics", row["step"])
