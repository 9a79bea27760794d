"""Deterministic kill -9 points for the kill/resume tests, installed from outside the product code.

    TRL_GRPO_EXT_TEST_KILL="<point>:<step>" python tests/kill_points.py SCRIPT [ARGS...]

runs SCRIPT (a recipe) in this process after patching one function, so that the process SIGKILLs itself at the
point named (tests/test_kill_resume.py; without the variable, SCRIPT runs untouched):

- ``step``: TRL: optimizer step N is done but neither logged nor checkpointed (the trainer's `on_step_end` event,
  which `transformers.Trainer` fires between the update and `_maybe_log_save_evaluate`);
- ``save``: TRL: inside checkpoint-N's save, after the model and optimizer are written and before
  trainer_state.json (`transformers.Trainer._save_checkpoint` saves the RNG state in between); PyTRIO: step N's
  checkpoint is saved by the service but not yet recorded in pytrio_state.json (the loop's `save_loop_state`);
- ``metrics``: half of step N's metrics.jsonl row reaches the file (the run logger's `append_jsonl_row`, both paths);
- ``interrupt``: TRL: Ctrl-C (SIGINT, not a kill) once optimizer step N is done, at the same event as ``step``.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEST_KILL_ENV = "TRL_GRPO_EXT_TEST_KILL"
KILL_POINTS = ("step", "save", "metrics", "interrupt")
SCRIPT = Path(__file__).resolve()


def parse(spec: str) -> tuple[str, int]:
    """("point", step) of "<point>:<step>"; ValueError for anything else."""
    point, _, step = spec.partition(":")
    if point not in KILL_POINTS:
        raise ValueError(f"unknown kill point {point!r}; valid: {', '.join(KILL_POINTS)}")
    if not step.isdigit():
        raise ValueError(f"kill point {spec!r} needs a step number: <point>:<step>")
    return point, int(step)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str | None = None, patch=setattr) -> tuple[str, int] | None:
    """Patch the functions of `spec`'s kill point (default $TRL_GRPO_EXT_TEST_KILL; unset: nothing). `patch` is
    `setattr`, or a test's `monkeypatch.setattr` so the patch is undone after it."""
    spec = spec if spec is not None else os.environ.get(TEST_KILL_ENV, "")
    if not spec:
        return None
    point, step = parse(spec)
    if point == "interrupt":  # as in a terminal, whatever the test runner's SIGINT (a background job ignores it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if point in ("step", "interrupt"):
        from transformers.trainer_callback import CallbackHandler

        on_step_end = CallbackHandler.on_step_end

        def killing_on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                _die() if point == "step" else os.kill(os.getpid(), signal.SIGINT)
            return on_step_end(self, args, state, control, **kwargs)

        patch(CallbackHandler, "on_step_end", killing_on_step_end)
    elif point == "save":
        from transformers import Trainer

        from trl_grpo_ext.pytrio import checkpoints

        save_rng_state, save_loop_state = Trainer._save_rng_state, checkpoints.save_loop_state

        def killing_save_rng_state(self, output_dir):
            if self.state.global_step == step:
                _die()
            return save_rng_state(self, output_dir)

        def killing_save_loop_state(output_dir, state):
            if state.step == step:
                _die()
            return save_loop_state(output_dir, state)

        patch(Trainer, "_save_rng_state", killing_save_rng_state)
        patch(checkpoints, "save_loop_state", killing_save_loop_state)
    else:
        from trl_grpo_ext.runs import METRICS_FILENAME
        from trl_grpo_ext.runs import metrics as metrics_file

        append = metrics_file.append_jsonl_row

        def tearing_append(path, row):
            if Path(path).name == METRICS_FILENAME and row.get("step") == step:
                data = (json.dumps(row) + "\n").encode("utf-8")
                with open(path, "a+b") as handle:
                    metrics_file._repair_torn_tail(handle)
                    handle.write(data[: len(data) // 2])
                    handle.flush()
                _die()
            return append(path, row)

        patch(metrics_file, "append_jsonl_row", tearing_append)
    return point, step


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    install()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
