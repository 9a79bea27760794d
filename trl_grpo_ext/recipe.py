"""Building blocks of `recipes/gsm8k_grpo.py`: model, datasets, rewards and the end-of-run report."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from trl_grpo_ext.metrics_log import EVAL_BEFORE_AFTER_FILENAME, METRICS_FILENAME, read_metrics

RUN_SUMMARY_FILENAME = "run_summary.json"
_START = time.time()


def load_model_and_tokenizer(model_args, training_args):
    """Model and tokenizer for `model_args.model_name_or_path` ('embedded', a hub id or a local path)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.models import resolve_model

    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is not set; use 'embedded', a hub id or a local path")
    path = resolve_model(model_args.model_name_or_path)
    dtype = model_args.dtype
    if dtype not in (None, "auto"):
        dtype = getattr(torch, dtype)
    elif dtype is None:
        dtype = "auto"
    trust_remote_code = getattr(training_args, "trust_remote_code", False)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=model_args.model_revision,
        trust_remote_code=trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
    )
    if training_args.gradient_checkpointing:
        model.config.use_cache = False
    return model, tokenizer


def _use_chat(script_args, tokenizer) -> bool:
    if script_args.prompt_format == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    if script_args.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt_format: chat, but the tokenizer has no chat template; use 'text' or 'auto'")
    return script_args.prompt_format == "chat"


def prompts_per_run(training_args) -> int:
    """Distinct prompts `max_steps` optimizer steps consume (one process): enough data, nothing generated twice."""
    completions = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    per_step = max(1, completions // training_args.num_generations) * training_args.world_size
    return max(1, training_args.max_steps) * per_step // max(1, training_args.num_iterations)


def build_datasets(script_args, training_args, tokenizer):
    """(train dataset with `prompt`/`answer`, eval problems [{'prompt','answer'}] or [])."""
    from trl_grpo_ext.data import load_dataset_split, load_problems
    from trl_grpo_ext.data.prompts import build_prompt

    chat = _use_chat(script_args, tokenizer)
    num_train = script_args.num_train_samples
    if num_train is None and script_args.dataset_name == "synthetic" and training_args.max_steps > 0:
        num_train = prompts_per_run(training_args) + 64
    common = dict(tasks=script_args.synthetic_tasks, seed=training_args.seed, on_malformed=script_args.on_malformed)
    train = load_dataset_split(
        script_args.dataset_name,
        script_args.dataset_train_split,
        num_samples=num_train,
        one_shot=script_args.one_shot,
        chat=chat,
        **common,
    )
    eval_problems = []
    if script_args.eval_num_samples:
        rows = load_problems(
            script_args.dataset_name, script_args.dataset_test_split, script_args.eval_num_samples, **common
        )
        eval_problems = [
            {"prompt": build_prompt(r["question"], one_shot=script_args.one_shot, chat=chat), "answer": r["answer"]}
            for r in rows
        ]
    return train, eval_problems


def reward_functions(names, training_args=None, tokenizer=None):
    """Registry rewards by name; the trainer's length limit and EOS let `hybrid` veto truncated completions."""
    from trl_grpo_ext import get_reward_funcs

    eos = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else None
    limit = getattr(training_args, "max_completion_length", None)
    return get_reward_funcs(list(names), max_completion_length=limit, eos_token_ids=eos)


def peak_rss_gb() -> float:
    """Peak resident memory of this process and its finished children, in GB (Linux reports KiB)."""
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(self_kib, child_kib) * 1024 / 1e9


def summarize_metrics(rows: list[dict], window: int = 10) -> dict:
    """Mean reward of the first and last `window` logged steps (and their difference)."""
    rewards = [row["reward"] for row in rows if isinstance(row.get("reward"), (int, float))]
    if not rewards:
        return {"logged_steps": len(rows)}
    window = max(1, min(window, len(rewards) // 2 or 1))
    first, last = rewards[:window], rewards[-window:]
    zero_std = [row["frac_reward_zero_std"] for row in rows if isinstance(row.get("frac_reward_zero_std"), (int, float))]
    out = {
        "logged_steps": len(rows),
        "window": window,
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        "frac_reward_zero_std_mean": sum(zero_std) / len(zero_std) if zero_std else None,
    }
    out["reward_gain"] = out["reward_last"] - out["reward_first"]
    return out


def report_run(trainer, training_args) -> dict:
    """Write `<output_dir>/run_summary.json` (rewards first vs last, eval before/after, wall time, peak RSS) and print it."""
    if not trainer.is_world_process_zero():
        return {}
    out_dir = Path(training_args.output_dir)
    summary = summarize_metrics(read_metrics(out_dir / METRICS_FILENAME))
    eval_path = out_dir / EVAL_BEFORE_AFTER_FILENAME
    if eval_path.exists():
        summary["eval"] = json.loads(eval_path.read_text())
    import torch

    summary["torch_threads"] = torch.get_num_threads()
    summary["wall_time_s"] = round(time.time() - _START, 1)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    summary["cpu_time_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    summary["peak_rss_gb"] = round(peak_rss_gb(), 2)
    (out_dir / RUN_SUMMARY_FILENAME).write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"run summary ({out_dir / RUN_SUMMARY_FILENAME}):"]
    if "reward_first" in summary:
        lines.append(
            f"  mean reward, first {summary['window']} logged steps: {summary['reward_first']:.3f}; "
            f"last {summary['window']}: {summary['reward_last']:.3f}"
        )
    for label, result in summary.get("eval", {}).items():
        lines.append(f"  eval {label}: greedy accuracy {result['accuracy']:.3f}, boxed {result['boxed_rate']:.3f}")
    lines.append(
        f"  wall time {summary['wall_time_s']} s (CPU time {summary['cpu_time_s']} s, {summary['torch_threads']} torch "
        f"threads), peak RSS {summary['peak_rss_gb']} GB"
    )
    print("\n".join(lines), file=sys.stdout, flush=True)
    return summary
