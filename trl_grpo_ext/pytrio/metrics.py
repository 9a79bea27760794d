"""Where the PyTRIO loop's step metrics go: ``<output_dir>/metrics.jsonl`` (the TRL path's format) and SwanLab.

The reward statistics are computed by `trl_grpo_ext.reward_aggregation` (TRL 1.16's definitions), so both paths'
curves are comparable; NaN values (e.g. the std of a step with one scorable completion) are written as null.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from trl_grpo_ext.pytrio.connection import redact
from trl_grpo_ext.run_files import METRICS_FILENAME, append_jsonl_row, truncate_metrics

logger = logging.getLogger(__name__)


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; readers treat null as missing (as the TRL path's callback does)
    return value


class MetricsSink:
    """Appends one JSON object per optimizer step (with ``"step"``) and mirrors it to SwanLab if enabled."""

    def __init__(
        self,
        output_dir,
        report_to: str = "none",
        run_config: dict | None = None,
        run_name=None,
        project: str = "trl-grpo-ext",
        swanlab_mode: str | None = None,
        fresh: bool = True,
    ):
        self.path = Path(output_dir) / METRICS_FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            truncate_metrics(self.path, 0)
        self._swanlab = None
        if report_to == "swanlab":
            self._swanlab = self._init_swanlab(Path(output_dir), run_config or {}, run_name, project, swanlab_mode)

    @staticmethod
    def _init_swanlab(output_dir: Path, run_config: dict, run_name, project: str, mode: str | None):
        # swanlab 0.10 does not pick up a run by itself outside its own integrations: init it here.
        import swanlab

        mode = mode or os.environ.get("SWANLAB_MODE") or "offline"
        if mode == "cloud":
            mode = "online"
        try:
            swanlab.init(
                project=project,
                name=run_name or output_dir.name,
                mode=mode,
                log_dir=str(output_dir / "swanlog"),
                config=run_config,
            )
        except Exception as error:  # noqa: BLE001 - tracking must not stop a training run
            logger.warning("SwanLab could not start (%s); metrics go to %s only", redact(error), METRICS_FILENAME)
            return None
        return swanlab

    def log(self, step: int, metrics: dict) -> dict:
        row = {"step": int(step)}
        row.update({key: _jsonable(value) for key, value in metrics.items()})
        append_jsonl_row(self.path, row)  # a torn last line (a kill mid-write) is repaired first
        if self._swanlab is not None:
            numeric = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            try:
                self._swanlab.log(numeric, step=int(step))
            except Exception as error:  # noqa: BLE001
                logger.warning("SwanLab log failed at step %d: %s", step, redact(error))
        return row

    def close(self) -> None:
        if self._swanlab is not None:
            try:
                self._swanlab.finish()
            except Exception as error:  # noqa: BLE001
                logger.warning("SwanLab finish failed: %s", redact(error))
            self._swanlab = None
