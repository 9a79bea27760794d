"""A PyTRIO `GRPOLoop` that stops early, as a kill would, for the in-process resume tests."""

from __future__ import annotations

from trl_grpo_ext.pytrio.loop import GRPOLoop
from trl_grpo_ext.runs.loop_state import load_loop_state


class _Stopped(Exception):
    def __init__(self, steps_done: int):
        super().__init__(f"stopped after step {steps_done}")
        self.steps_done = steps_done


class StoppingLoop(GRPOLoop):
    """`GRPOLoop` whose `run` stops once `stop_after` steps of this invocation are done (each logged, and
    checkpointed when `save_every` says so): the next step is never sampled and nothing after the loop runs (no
    final checkpoint; so `stop_after` is fewer than the steps left). Returns ``{"stopped_at": steps done,
    "state_path": the loop state's checkpoint or None}``."""

    def __init__(self, *args, stop_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_after = stop_after
        self._steps_here = 0

    def train_step(self, training_client, stream, step: int) -> dict:
        if self._steps_here >= self.stop_after:
            raise _Stopped(step)
        self._steps_here += 1
        return super().train_step(training_client, stream, step)

    def run(self) -> dict:
        self._steps_here = 0
        try:
            return super().run()
        except _Stopped as stop:
            state = load_loop_state(self.config.output_dir)
            return {"stopped_at": stop.steps_done, "state_path": state.state_path if state else None}
