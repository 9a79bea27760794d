"""SwanLab for both execution paths: which mode, and starting the run that logs under `<output_dir>/swanlog`."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import field
from pathlib import Path

from trl_grpo_ext.runs.names import METRICS_FILENAME, SWANLAB_DIRNAME

logger = logging.getLogger(__name__)

DEFAULT_SWANLAB_PROJECT = "trl-grpo-ext"


def swanlab_project_field():
    """The ``swanlab_project`` option, as both paths' configs declare it."""
    return field(default=DEFAULT_SWANLAB_PROJECT, metadata={"help": "SwanLab project (report_to: swanlab)."})


def swanlab_mode_field():
    """The ``swanlab_mode`` option, as both paths' configs declare it (values: `trl_grpo_ext.grpo.spec`)."""
    return field(
        default=None,
        metadata={
            "help": "SwanLab mode: online, offline (logs under output_dir, no network), local or disabled ('cloud': "
            "deprecated name of online). Default: $SWANLAB_MODE, else online when an API key is configured, else "
            "offline."
        },
    )


def jsonable(value):
    """A metric value as a row holds it: tensors and numpy scalars as Python numbers, NaN / inf as None (JSON has
    no NaN; readers treat null as missing)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def swanlab_mode(requested: str | None = None) -> str:
    """The SwanLab mode to use: `requested` (a config's `swanlab_mode`, checked by `grpo_spec`), else $SWANLAB_MODE,
    else online with an API key (SWANLAB_API_KEY or one saved by `swanlab login`), else offline."""
    if requested:
        return requested
    if os.environ.get("SWANLAB_MODE"):
        return os.environ["SWANLAB_MODE"]
    if os.environ.get("SWANLAB_API_KEY"):
        return "online"
    try:  # a key saved by `swanlab login`
        from swanlab.sdk.internal.settings import create_settings

        if create_settings().api_key:
            return "online"
    except Exception:
        pass
    return "offline"


def start_swanlab(
    output_dir,
    project: str = DEFAULT_SWANLAB_PROJECT,
    run_name: str | None = None,
    mode: str | None = None,
    config: dict | None = None,
    required: bool = True,
    redact=str,
):
    """Start the run's SwanLab run (offline logs under `<output_dir>/swanlog`); None in 'disabled' mode.

    swanlab >= 0.10 has no active run unless one is started: transformers' SwanLab callback (`report_to: swanlab`)
    raises "No active Run" without it, and the PyTRIO loop logs into it directly. When it cannot start: a
    RuntimeError saying how to fix it, or with `required` False a warning (the message through `redact`) and None,
    so tracking never stops a training run.
    """
    import swanlab

    mode = swanlab_mode(mode)
    if mode == "disabled":
        return None
    log_dir = Path(output_dir) / SWANLAB_DIRNAME
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return swanlab.init(
            project=project,
            name=run_name or Path(output_dir).name,
            mode=mode,
            log_dir=str(log_dir),
            config=config or {},
            reinit=True,
        )
    except Exception as err:
        hint = {
            "online": " Log in with `swanlab login` (or set SWANLAB_API_KEY), or use swanlab_mode: offline.",
            "local": " Local mode needs the dashboard: pip install 'swanlab[dashboard]'.",
        }.get(mode, "")
        message = f"could not start SwanLab in {mode!r} mode ({type(err).__name__}: {err}).{hint}"
        if required:
            raise RuntimeError(message) from err
        logger.warning("%s Metrics go to %s only.", redact(message), METRICS_FILENAME)
        return None
