"""SwanLab for both execution paths: the ``swanlab_*`` options and their checks, which mode, and starting the run
that logs under `<output_dir>/swanlog`."""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import field
from pathlib import Path

from trl_grpo_ext.runs.names import METRICS_FILENAME, SWANLAB_DIRNAME

logger = logging.getLogger(__name__)

DEFAULT_SWANLAB_PROJECT = "trl-grpo-ext"
# SwanLab's own mode names (swanlab >= 0.10); both paths' `swanlab_mode` takes these.
SWANLAB_MODES = ("online", "offline", "local", "disabled")
# Old spellings of ``swanlab_mode``, accepted with a FutureWarning and replaced: {old: new}.
DEPRECATED_SWANLAB_MODES = {"cloud": "online"}  # the PyTRIO path's former name; SwanLab maps it to online too


def swanlab_project_field():
    """The ``swanlab_project`` option, as both paths' configs declare it."""
    return field(default=DEFAULT_SWANLAB_PROJECT, metadata={"help": "SwanLab project (report_to: swanlab)."})


def swanlab_mode_field():
    """The ``swanlab_mode`` option, as both paths' configs declare it (values: `SWANLAB_MODES`)."""
    return field(
        default=None,
        metadata={
            "help": "SwanLab mode: online, offline (logs under output_dir, no network), local or disabled ('cloud': "
            "deprecated name of online). Default: $SWANLAB_MODE, else online when an API key is configured, else "
            "offline."
        },
    )


def normalize_swanlab_mode(config) -> None:
    """Before validation: a deprecated ``swanlab_mode`` value (`DEPRECATED_SWANLAB_MODES`) replaced, with a
    FutureWarning naming the new one."""
    mode = getattr(config, "swanlab_mode", None)
    if isinstance(mode, str) and mode in DEPRECATED_SWANLAB_MODES:
        new = DEPRECATED_SWANLAB_MODES[mode]
        warnings.warn(f"swanlab_mode: {mode!r} is deprecated, use {new!r} (it means the same)", FutureWarning, 3)
        config.swanlab_mode = new


def swanlab_mode_problems(mode) -> list[str]:
    """The one check of ``swanlab_mode`` (both paths; None: `swanlab_mode` picks one)."""
    if mode is None or mode in SWANLAB_MODES:
        return []
    return [f"swanlab_mode={mode!r} is not valid; valid values: {', '.join(SWANLAB_MODES)} (or unset)"]


def jsonable(value):
    """A metric value as a row holds it: tensors and numpy scalars as Python numbers, NaN / inf as None (JSON has
    no NaN; readers treat null as missing)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def swanlab_mode(requested: str | None = None) -> str:
    """The SwanLab mode to use: `requested` (a config's `swanlab_mode`, checked by `swanlab_mode_problems`), else $SWANLAB_MODE,
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
