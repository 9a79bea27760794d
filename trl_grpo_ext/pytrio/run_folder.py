"""The loop's run folder: ``config.yaml`` written and the run's logger opened (`open_run_folder`); a failed write
to it (a full disk) one `PyTrioLoopError` line saying which checkpoint is kept (`output_errors`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import redact
from trl_grpo_ext.runs import CONFIG_FILENAME, write_run_config
from trl_grpo_ext.runs.loop_state import load_loop_state
from trl_grpo_ext.runs.metrics import RunLogger
from trl_grpo_ext.runs.tracking import start_swanlab


def kept_checkpoint(out: Path) -> str:
    """What a resume from `out` would start from, as the loop state on disk says."""
    try:
        state = load_loop_state(out)
    except (OSError, ValueError):
        state = None
    if state is None or not state.state_path:
        return "no checkpoint was saved yet"
    return f"the checkpoint of step {state.step} is kept"


@contextlib.contextmanager
def output_errors(out: Path, filename: str):
    """A failed write to the run folder (a full disk) as one `PyTrioLoopError` line saying what is kept."""
    try:
        yield
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise PyTrioLoopError(
            f"cannot write {filename} in {out} ({reason}): the run stopped and {kept_checkpoint(out)}; free space, "
            "then rerun with resume: true"
        ) from None


def open_run_folder(config: PyTrioGRPOConfig, out: Path) -> RunLogger:
    """config.yaml written, SwanLab started: the run's logger."""
    c = config
    with output_errors(out, CONFIG_FILENAME):
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(out, {**c.to_dict(), "backend": "pytrio"})
    swanlab = None
    if c.report_to == "swanlab":
        swanlab = start_swanlab(
            out, c.swanlab_project, c.run_name, c.swanlab_mode, c.to_dict(), required=False, redact=redact
        )
    return RunLogger(out, swanlab, redact)
