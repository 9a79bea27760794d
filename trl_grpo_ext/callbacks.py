"""Trainer callbacks: `metrics.jsonl` for the comparison tools, and SwanLab setup for TRL recipes.

`<output_dir>/metrics.jsonl` holds one JSON object per logged optimizer step: `"step"` plus TRL's logged
keys (`reward`, `rewards/<name>/mean`, `frac_reward_zero_std`, `entropy`, ...) plus ours (`step_time`).
The PyTRIO loop writes the same format (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from trl_grpo_ext.run_files import (
    EVAL_BEFORE_AFTER_FILENAME,
    EVAL_METRICS_FILENAME,
    METRICS_FILENAME,
    append_jsonl_row,
    maybe_kill,
    truncate_metrics,
)

# Keys of the end-of-training summary log (not a step's metrics).
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; readers treat null as missing
    return value


class MetricsJsonlCallback(TrainerCallback):
    """Append each logged step's metrics to `<output_dir>/metrics.jsonl` (main process only).

    On resume from a checkpoint, rows logged after that checkpoint are dropped first: those steps run
    again, so the file ends with exactly one row per logged step.
    """

    def __init__(self, output_dir: str | None = None, filename: str = METRICS_FILENAME):
        self.output_dir = output_dir
        self.filename = filename
        self._step_start = None
        self._step_times: list[float] = []

    def _path(self, args) -> Path:
        return Path(self.output_dir or args.output_dir) / self.filename

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        # A fresh run (global_step 0) starts a new file; a resumed one keeps rows up to its checkpoint.
        truncate_metrics(self._path(args), state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self._step_times.append(time.perf_counter() - self._step_start)
            self._step_start = None
        # Test-only kill point: the optimizer step is done but neither logged nor checkpointed.
        maybe_kill("step", int(state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if _SUMMARY_KEYS & set(logs):
            return
        if all(key.startswith("eval_") for key in logs if key != "epoch"):
            filename = EVAL_METRICS_FILENAME
        else:
            filename = self.filename
        row = {"step": int(state.global_step)}
        row.update({key: _jsonable(value) for key, value in logs.items()})
        if filename == self.filename and self._step_times:
            row.setdefault("step_time", sum(self._step_times) / len(self._step_times))
            self._step_times = []
        append_jsonl_row(Path(self.output_dir or args.output_dir) / filename, row)


# ------------------------------------------------------------------------------------------- SwanLab


def swanlab_mode(requested: str | None = None) -> str:
    """The SwanLab mode to use: `requested`, else $SWANLAB_MODE, else online with an API key, else offline."""
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


def init_swanlab(args, project: str = "trl-grpo-ext", mode: str | None = None, config: dict | None = None):
    """Start the SwanLab run before the trainer is built.

    transformers' own SwanLab callback (`report_to: swanlab`) calls `swanlab.get_run()`, which raises
    "No active Run" in swanlab >= 0.10 unless a run exists; starting it here also lets us choose the mode
    and keep offline logs under `<output_dir>/swanlog`. Returns the run, or None in 'disabled' mode.
    """
    import swanlab

    mode = swanlab_mode(mode)
    if mode == "disabled":
        return None
    log_dir = Path(args.output_dir) / "swanlog"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return swanlab.init(
            project=project,
            name=args.run_name or Path(args.output_dir).name,
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
        raise RuntimeError(f"could not start SwanLab in {mode!r} mode ({type(err).__name__}: {err}).{hint}") from err


class SwanLabCompletionsCallback(TrainerCallback):
    """Log the latest generation batch (prompt, completion, each reward, advantage) as a SwanLab table."""

    def __init__(self, trainer=None, max_rows: int = 16):
        self.trainer = trainer
        self.max_rows = max_rows

    def on_log(self, args, state, control, logs=None, **kwargs):
        trainer = self.trainer
        if trainer is None or not state.is_world_process_zero or not hasattr(trainer, "_logs"):
            return
        import swanlab

        if not swanlab.has_run():
            return
        batch = trainer._logs
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
            row += [_jsonable(values[i]) if i < len(values) else None for values in rewards.values()]
            row.append(_jsonable(advantages[i]) if i < len(advantages) else None)
            rows.append(row)
        swanlab.log({"completions": swanlab.echarts.Table().add(headers, rows)}, step=state.global_step)


# ------------------------------------------------------------------------------------ before/after eval


def greedy_accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int, batch_size: int = 16) -> dict:
    """Greedy pass@1 and `\\boxed{}` rate of `model` on problems {'prompt', 'answer'} (answer: GSM8K style)."""
    import torch

    from trl_grpo_ext.answers import parse_ground_truth
    from trl_grpo_ext.evaluation import extract_prediction, is_correct

    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    # Similar lengths together: less padding to run through the model.
    order = sorted(range(len(problems)), key=lambda i: len(str(problems[i]["prompt"])))
    correct, boxed, lengths = 0, 0, []
    try:
        for start in range(0, len(order), batch_size):
            batch = [problems[i] for i in order[start : start + batch_size]]
            texts = [
                p["prompt"]
                if isinstance(p["prompt"], str)
                else tokenizer.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True)
                for p in batch
            ]
            # A chat template already writes its special tokens; plain text gets the tokenizer's own.
            chat = any(not isinstance(p["prompt"], str) for p in batch)
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(model.device)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = out[:, enc["input_ids"].shape[1] :]
            for problem, ids, text in zip(batch, new, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True):
                pred = extract_prediction(text)
                boxed += pred is not None
                correct += is_correct(pred, parse_ground_truth(problem["answer"]))
                lengths.append(int((ids != tokenizer.pad_token_id).sum()))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    n = max(len(problems), 1)
    return {"n": len(problems), "accuracy": correct / n, "boxed_rate": boxed / n, "mean_length": sum(lengths) / n}


class BeforeAfterEvalCallback(TrainerCallback):
    """Greedy accuracy on held-out problems at the start and the end of training.

    Writes `<output_dir>/eval_before_after.json` and prints one line per eval; the numbers are also logged
    to metrics.jsonl-independent trackers as `eval_before/*` and `eval_after/*` through the returned dict.
    """

    def __init__(self, problems: list[dict], max_new_tokens: int, batch_size: int = 16):
        if not problems:
            raise ValueError("BeforeAfterEvalCallback needs at least one problem")
        self.problems = problems
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.results: dict = {}

    def _run(self, label, args, state, model, tokenizer):
        start = time.perf_counter()
        result = greedy_accuracy(model, tokenizer, self.problems, self.max_new_tokens, self.batch_size)
        result.update(step=int(state.global_step), seconds=round(time.perf_counter() - start, 1))
        self.results[label] = result
        if state.is_world_process_zero:
            print(
                f"[eval {label}] step {state.global_step}: greedy accuracy {result['accuracy']:.3f}, boxed "
                f"{result['boxed_rate']:.3f} on {result['n']} held-out problems ({result['seconds']} s)",
                flush=True,
            )
            path = Path(args.output_dir) / EVAL_BEFORE_AFTER_FILENAME
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.results, indent=2) + "\n")

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._run("before", args, state, model, processing_class)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._run("after", args, state, model, processing_class)
