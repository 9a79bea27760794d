"""Trainer callbacks of the TRL recipes: `metrics.jsonl` rows (`runs.RunLogger`, the PyTRIO loop's writer too), the
latest completions as a SwanLab table, and the greedy held-out eval before and after training.

`<output_dir>/metrics.jsonl` holds one JSON object per logged optimizer step: `"step"` plus TRL's logged
keys (`reward`, `rewards/<name>/mean`, `frac_reward_zero_std`, `entropy`, `step_time`, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

from transformers import TrainerCallback

from trl_grpo_ext.cpu.precision import bf16_on_cpu
from trl_grpo_ext.evaluation import (
    RECIPE_EVAL_BATCH_SIZE,
    EvalOptions,
    HFGenerator,
    as_problems,
    cached_greedy_eval,
    eval_cache_key,
    eval_set_hash,
    evaluate,
    format_paired,
    greedy_summary,
    heldout_line,
    live_model_identity,
    live_model_settings,
    load_cached_eval,
    paired_comparison,
    read_results,
    write_results,
)
from trl_grpo_ext.interrupts import GracefulStop
from trl_grpo_ext.runs import (
    EVAL_AFTER_PROBLEMS_FILENAME,
    EVAL_BEFORE_AFTER_FILENAME,
    EVAL_BEFORE_PROBLEMS_FILENAME,
    EVAL_METRICS_FILENAME,
    METRICS_FILENAME,
    atomic_write_json,
)
from trl_grpo_ext.runs.metrics import RunLogger
from trl_grpo_ext.runs.tracking import jsonable
from trl_grpo_ext.trl.internals import completions_log

# Keys of the end-of-training summary log (not a step's metrics).
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


class MetricsJsonlCallback(TrainerCallback):
    """Append each logged step's metrics to `<output_dir>/metrics.jsonl` (main process only), through `RunLogger`.

    On resume from a checkpoint, rows logged after that checkpoint are dropped first: those steps run
    again, so the file ends with exactly one row per logged step. The trainer's own `eval_*` logs go to
    `eval_metrics.jsonl`.
    """

    def __init__(self, output_dir: str | None = None):
        self.output_dir = output_dir

    def _logger(self, args) -> RunLogger:
        return RunLogger(self.output_dir or args.output_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        # A fresh run (global_step 0) starts a new file; a resumed one keeps rows up to its checkpoint.
        self._logger(args).start(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if _SUMMARY_KEYS & set(logs):
            return
        evaluation = all(key.startswith("eval_") for key in logs if key != "epoch")
        self._logger(args).log(state.global_step, logs, EVAL_METRICS_FILENAME if evaluation else METRICS_FILENAME)


class TrainingPhaseCallback(TrainerCallback):
    """The training phase's wall time, and Ctrl-C as a stop with a checkpoint.

    ``seconds``: from the first step's start to the last step's end (the evals before and after training left out).
    Ctrl-C (SIGINT) during training stops the run at the end of the step being trained, saving a checkpoint there
    (also with ``save_strategy: no``), which ``resume_from_checkpoint: true`` continues from; the evaluation after
    training is skipped. A second Ctrl-C stops at once (`trl_grpo_ext.interrupts.GracefulStop`).
    """

    def __init__(self):
        self.started: float | None = None
        self.ended: float | None = None
        self.stop = GracefulStop(
            "stopping after this step with a checkpoint (resume_from_checkpoint: true continues it)"
        )

    @property
    def interrupted(self) -> bool:
        return self.stop.requested

    @property
    def seconds(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started

    def on_train_begin(self, args, state, control, **kwargs):
        self.stop.install()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.started is None:
            self.started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = time.monotonic()
        if self.stop.requested:
            control.should_save = True
            control.should_training_stop = True
            state.interrupted = True  # read by BeforeAfterEvalCallback: no eval of a run stopped half way

    def on_train_end(self, args, state, control, **kwargs):
        self.stop.restore()


class SwanLabCompletionsCallback(TrainerCallback):
    """Log the latest generation batch (prompt, completion, each reward, advantage) as a SwanLab table."""

    def __init__(self, trainer=None, max_rows: int = 16):
        self.trainer = trainer
        self.max_rows = max_rows

    def on_log(self, args, state, control, logs=None, **kwargs):
        batch = None if self.trainer is None else completions_log(self.trainer)
        if batch is None or not state.is_world_process_zero:
            return
        import swanlab

        if not swanlab.has_run():
            return
        prompts, completions = list(batch["prompt"]), list(batch["completion"])
        if not completions:
            return
        rewards = {name: list(values) for name, values in batch["rewards"].items()}
        advantages = list(batch["advantages"])
        headers = ["prompt", "completion", *rewards, "advantage"]
        rows = []
        for i in range(min(len(completions), self.max_rows)):
            prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
            completion = completions[i][-1]["content"] if isinstance(completions[i], list) else completions[i]
            row = [str(prompt), str(completion)]
            row += [jsonable(values[i]) if i < len(values) else None for values in rewards.values()]
            row.append(jsonable(advantages[i]) if i < len(advantages) else None)
            rows.append(row)
        swanlab.log({"completions": swanlab.echarts.Table().add(headers, rows)}, step=state.global_step)


# ------------------------------------------------------------------------------------ before/after eval


def _eval_bf16(args) -> bool:
    """Whether the run's evals sample in bf16 autocast, as its generation does (`precision.bf16_on_cpu`)."""
    return bool(getattr(args, "bf16", False)) and bf16_on_cpu(True, args.device.type)


class BeforeAfterEvalCallback(TrainerCallback):
    """Greedy held-out eval at the start and the end of training, and the paired gain between the two.

    Writes to output_dir (main process): `eval_before_after.json` (each eval's figures, overall and per task, and
    `paired`: the gain of each figure on the same problems with its 95% paired-bootstrap interval and exact
    McNemar p-value) and the per-problem results `eval_before.jsonl` / `eval_after.jsonl`.

    The "before" eval comes from the on-disk cache when this model was already evaluated on these problems
    with these settings (`evaluation.cached_greedy_eval`). A resumed run keeps its step-0 "before" eval from
    the run folder (else the cache); it never evaluates resumed weights as "before".

    `options`: the eval's `EvalOptions` (the recipes': `evaluation.recipe_eval_options`); it uses the token limit,
    batch size, cache and progress ones. Keyword `overrides` replace fields of it (`max_new_tokens=64`).
    """

    def __init__(self, problems: list, options: EvalOptions | None = None, **overrides):
        if options is not None and not isinstance(options, EvalOptions):
            raise TypeError(f"BeforeAfterEvalCallback: options must be EvalOptions, got {type(options).__name__}")
        if not problems:
            raise ValueError("BeforeAfterEvalCallback needs at least one problem")
        self.problems = as_problems(problems)
        self.options = dataclasses.replace(options or EvalOptions(batch_size=RECIPE_EVAL_BATCH_SIZE), **overrides)
        self.results: dict = {}
        self.before = None  # per-problem results of the "before" eval

    def _eval_set(self) -> dict:
        return {
            "n": len(self.problems),
            "sha256": eval_set_hash(self.problems),
            "max_new_tokens": self.options.max_new_tokens,
            "batch_size": self.options.batch_size,
        }

    def _write(self, args) -> None:
        atomic_write_json(Path(args.output_dir) / EVAL_BEFORE_AFTER_FILENAME, self.results, indent=2)

    def _resumed_before(self, out: Path, eval_set: dict):
        """The step-0 results a previous attempt of this run wrote, if they are of this eval set."""
        try:
            saved = json.loads((out / EVAL_BEFORE_AFTER_FILENAME).read_text())
            if saved.get("eval_set", {}).get("sha256") != eval_set["sha256"] or "before" not in saved:
                return None, None
            results = read_results(out / EVAL_BEFORE_PROBLEMS_FILENAME)
        except (OSError, ValueError, AttributeError):
            return None, None
        return (results, saved["before"]) if len(results) == len(self.problems) else (None, None)

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        o = self.options
        out, main = Path(args.output_dir), state.is_world_process_zero
        eval_set = self._eval_set()
        identity = live_model_identity(model) if o.cache else None
        settings = live_model_settings(model, o.max_new_tokens, o.decode_engine)
        if _eval_bf16(args):  # bf16 results are not fp32's: their own cache entry (fp32 keys stay as they were)
            settings["autocast"] = "bfloat16"
        start = time.perf_counter()
        if state.global_step > 0:  # resumed: the weights are no longer the "before" model's
            results, entry = self._resumed_before(out, eval_set)
            source = "run folder"
            if results is None and identity is not None:
                key, _ = eval_cache_key(identity, self.problems, {**settings, "batch_size": o.batch_size})
                results, entry, source = load_cached_eval(key, len(self.problems)), None, "cache"
            if results is None:
                if main:
                    print(
                        f"[eval before] resumed at step {state.global_step} and the step-0 eval is neither in "
                        f"{out} nor in the eval cache: no before/after comparison for this run",
                        flush=True,
                    )
                self.results = {"eval_set": eval_set}
                return
        else:
            with contextlib.ExitStack() as stack:

                def borrow():
                    return stack.enter_context(
                        HFGenerator.borrowing(
                            model,
                            processing_class,
                            o.max_new_tokens,
                            bf16=_eval_bf16(args),
                            decode_engine=o.decode_engine,
                        )
                    )

                results, info = cached_greedy_eval(
                    self.problems,
                    borrow,
                    identity,
                    settings,
                    o.batch_size,
                    progress=o.progress and main,
                    desc="eval before",
                    write=main,
                )
            entry, source = None, "cache" if info["cached"] else "generated"
        self.before = results
        if entry is None:
            entry = {**greedy_summary(results), "step": 0, "seconds": round(time.perf_counter() - start, 1)}
        entry["source"] = source
        self.results = {"eval_set": eval_set, "before": entry}
        if main:
            write_results(out / EVAL_BEFORE_PROBLEMS_FILENAME, results)
            self._write(args)
            print(f"[eval before] {heldout_line(entry)} ({source}, {entry.get('seconds')} s)", flush=True)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        o, main = self.options, state.is_world_process_zero
        if getattr(state, "interrupted", False):  # Ctrl-C (`TrainingPhaseCallback`): the run stops, unevaluated
            if main:
                print("[eval after] skipped: training was stopped by Ctrl-C", flush=True)
            return
        start = time.perf_counter()
        with HFGenerator.borrowing(
            model, processing_class, o.max_new_tokens, bf16=_eval_bf16(args), decode_engine=o.decode_engine
        ) as gen:
            results, _ = evaluate(self.problems, gen, 1, o.batch_size, progress=o.progress and main, desc="eval after")
        entry = {
            **greedy_summary(results),
            "step": int(state.global_step),
            "seconds": round(time.perf_counter() - start, 1),
        }
        self.results["after"] = entry
        if self.before is not None:
            self.results["paired"] = paired_comparison(self.before, results)
        if main:
            write_results(Path(args.output_dir) / EVAL_AFTER_PROBLEMS_FILENAME, results)
            self._write(args)
            print(f"[eval after] {heldout_line(entry)} ({entry['seconds']} s)", flush=True)
            for line in format_paired(self.results["paired"]) if "paired" in self.results else []:
                print(f"[eval paired] {line}", flush=True)
