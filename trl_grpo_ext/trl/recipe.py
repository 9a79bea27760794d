"""Building blocks of `recipes/gsm8k_grpo.py`: input checks, model, datasets, rewards, the run report.

The recipe checks everything a user can get wrong (`prepare_run`: config, reward names, model path, resume
checkpoint, tokenizer, data) before the model loads or any file of the run folder is written, so a failing rerun
leaves the previous run's files as they were.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trl_grpo_ext.cpu.threads import current_governor, govern_cpu_threads, runs_on_cpu
from trl_grpo_ext.environments import definition_problems, environment_factory
from trl_grpo_ext.environments.chat import use_tool_chat_template
from trl_grpo_ext.environments.data import with_environments
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.evaluation import HELDOUT_SEED, heldout_lines, problems_from_rows
from trl_grpo_ext.grpo.async_sampling import asynchronous, sampling_mode
from trl_grpo_ext.grpo.distillation import distillation_of
from trl_grpo_ext.grpo.loss_table import print_loss_type_notice
from trl_grpo_ext.grpo.reward_aggregation import reward_func_name
from trl_grpo_ext.grpo.spec import reward_option_problems
from trl_grpo_ext.models import resolve_model
from trl_grpo_ext.runs import (
    EVAL_BEFORE_AFTER_FILENAME,
    RUN_SUMMARY_FILENAME,
    atomic_write_json,
    resolve_resume_checkpoint,
    run_metrics,
    write_run_config,
)
from trl_grpo_ext.task.data import load_dataset_split, load_problems
from trl_grpo_ext.task.data.prompts import use_chat_prompts
from trl_grpo_ext.task.rewards import preflight_rewards, reward_functions, reward_names
from trl_grpo_ext.trl.distillation import teacher_problems

_START = time.time()


# ------------------------------------------------------------------------------------------ checks before loading


@dataclass
class PreparedRun:
    """What `prepare_run` checked and built: everything the trainer needs except the model."""

    model_path: str
    tokenizer: object
    reward_funcs: list  # reward models as `RewardModelReward`s: `trl_reward_inputs` hands them to TRL
    train_dataset: object
    eval_problems: list
    resume_from_checkpoint: str | None
    environment_factory: object = None  # TRL's environment_factory (a class, or {name: class}), or None


def prepare_run(script_args, training_args, model_args) -> PreparedRun:
    """Check every user input and build all but the model; raises ValueError / FileNotFoundError with one line.

    Nothing is written to the run folder and no model weights are loaded here.
    """
    print_loss_type_notice(training_args)  # our cispo is not TRL's: say which one runs, first
    names = list(script_args.reward_funcs)
    # unknown names, bad reward options, a reward model that is missing or no classifier: before anything slow;
    # then a judge that does not answer, before the embedded model is converted or anything is loaded
    preflight_rewards(reward_functions(names, training_args, settings=script_args))
    resume = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is not set; use 'embedded', a hub id or a local path")
    path = resolve_model(model_args.model_name_or_path, progress=not getattr(training_args, "disable_tqdm", False))
    tokenizer = load_tokenizer(path, model_args, training_args)
    distillation = distillation_of(training_args)
    if distillation is not None:  # a teacher that cannot load or tokenizes otherwise: one line, nothing written yet
        raise_problems("distillation", teacher_problems(distillation, tokenizer, model_args.model_name_or_path))
    train_dataset, eval_problems = build_datasets(script_args, training_args, tokenizer)
    factory = None
    if script_args.environments:
        factory = environment_factory(script_args.environments)
        raise_problems("environments", definition_problems(factory=factory))
        use_tool_chat_template(tokenizer)
        train_dataset = with_environments(
            train_dataset, script_args.environments, seed=training_args.seed, one_shot=script_args.one_shot
        )
    funcs = reward_functions(names, training_args, tokenizer, settings=script_args)
    check_reward_options(training_args, funcs, names)
    return PreparedRun(path, tokenizer, funcs, train_dataset, eval_problems, resume, factory)


def check_reward_options(training_args, funcs, entries=None) -> None:
    """The options that name reward functions (`trl_grpo_ext.grpo.spec.reward_option_problems`), as the trainer
    checks them when built, but before the model loads."""
    names = reward_names(entries, [reward_func_name(f) for f in funcs])
    raise_problems("GRPOConfig", reward_option_problems(training_args, names))


def load_tokenizer(path: str, model_args, training_args):
    from transformers import AutoTokenizer

    trust_remote_code = getattr(training_args, "trust_remote_code", False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=model_args.model_revision, trust_remote_code=trust_remote_code
        )
    except OSError as err:  # a hub id while offline, or a folder without tokenizer files: one line, not a traceback
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not load the tokenizer of model {path!r}: {first[:300]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, model_args, training_args):
    """The causal LM at `path` (resolved by `prepare_run`) with the recipe's dtype and attention settings."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = model_args.dtype
    if dtype not in (None, "auto"):
        dtype = getattr(torch, dtype)
    elif dtype is None:
        dtype = "auto"
    trust_remote_code = getattr(training_args, "trust_remote_code", False)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=model_args.model_revision,
        trust_remote_code=trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
    )
    if training_args.gradient_checkpointing:
        model.config.use_cache = False
    if not asynchronous(training_args):  # an asynchronous run's two sides keep fixed cores and threads
        govern_cpu_threads(model, on_cpu=runs_on_cpu(training_args))  # fewer threads while other processes are busy
    return model


def run_precision(training_args) -> dict | None:
    """The run's precision choice and its reason (`trl_grpo_ext.cpu.precision.Precision`), as run_summary.json keeps it;
    None for a plain `trl.GRPOConfig`, which has no `auto`."""
    precision = getattr(training_args, "precision", None)
    return precision.as_dict() if precision is not None else None


# Why the run samples as it does, when something other than the config chose it: ``<vllm|generate>: <why>``.
# `make train` sets it (its default sampler is the faster by measurement); unset, the reason is the config.
ENV_SAMPLER_REASON = "TRL_GRPO_EXT_SAMPLER_REASON"
SAMPLERS = ("vllm", "generate")


def sampler_choice(training_args, environ=None) -> dict:
    """The run's sampler and why: ``{"name": "vllm" | "generate", "reason": ...}``, plus vLLM's mode. The reason is
    `ENV_SAMPLER_REASON`'s when it names this sampler (a launcher that chose the recipe for it says why), else the
    config's. Raises ValueError (one line) for a malformed `ENV_SAMPLER_REASON`."""
    use_vllm = bool(getattr(training_args, "use_vllm", False))
    choice = {"name": "vllm" if use_vllm else "generate"}
    if use_vllm:
        choice["vllm_mode"] = training_args.vllm_mode
    reason = f"use_vllm: {'true' if use_vllm else 'false'} set in the config"
    given = " ".join((os.environ if environ is None else environ).get(ENV_SAMPLER_REASON, "").split())
    if given:
        named, sep, why = given.partition(": ")
        if not sep or named not in SAMPLERS or not why.strip():
            raise ValueError(f"{ENV_SAMPLER_REASON}={given[:200]!r} must read '<vllm|generate>: <why>'")
        # the launcher's reason, unless a command-line option changed its sampler (then the config's, and what it
        # overrode)
        reason = why.strip() if named == choice["name"] else f"{reason}, overriding {named} ({why.strip()})"
    choice["reason"] = reason
    return choice


def sampler_line(training_args) -> str:
    """The recipe's startup line on the sampler: ``sampler: <choice> (<why>)``, as `precision_line` for precision."""
    choice = sampler_choice(training_args)
    if choice["name"] == "vllm":
        return f"sampler: vLLM, {choice['vllm_mode']} mode ({choice['reason']})"
    engine = decode_engine(training_args)
    name = "transformers generate" if engine == "generate" else f"transformers, the {engine} decode engine"
    return f"sampler: {name} ({choice['reason']}; decode_engine: {engine})"


def decode_engine(training_args) -> str:
    """The loop that decodes for the in-process sampler (`GRPOConfig.decode_engine`; TRL's own config: generate)."""
    return getattr(training_args, "decode_engine", "generate")


def run_sampler(trainer, training_args) -> dict:
    """The run's sampler and why (`sampler_choice`), as run_summary.json keeps it; in colocate mode also how weights
    reached vLLM (`trl_grpo_ext.trl.vllm_cpu`)."""
    choice = sampler_choice(training_args)
    if choice["name"] == "vllm":
        choice["weight_sync"] = getattr(trainer, "vllm_weight_sync", None)
    else:
        choice["decode_engine"] = decode_engine(training_args)
    return choice


def precision_line(training_args) -> str:
    """The recipe's startup line on precision: the choice and why (`trl_grpo_ext.cpu.precision`)."""
    precision = getattr(training_args, "precision", None)
    if precision is None:
        return f"precision: {'bf16' if training_args.bf16 else 'fp32'} (bf16: {training_args.bf16})"
    return precision.line()


def prompts_per_run(training_args) -> int:
    """Distinct prompts `max_steps` optimizer steps consume (one process): enough data, nothing generated twice."""
    completions = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    per_step = max(1, completions // training_args.num_generations) * training_args.world_size
    return max(1, training_args.max_steps) * per_step // max(1, training_args.num_iterations)


def build_datasets(script_args, training_args, tokenizer):
    """(train dataset with `prompt`/`answer`, held-out eval `Problem`s (`evaluation.problems_from_rows`) or [])."""
    chat = use_chat_prompts(script_args.prompt_format, tokenizer)
    num_train = script_args.num_train_samples
    if training_args.max_steps > 0:  # synthetic data: enough problems for max_steps (`DataSpec.train_samples`)
        num_train = script_args.train_samples(prompts_per_run(training_args), training_args)
    common = dict(tasks=script_args.synthetic_tasks, seed=training_args.seed, on_malformed=script_args.on_malformed)
    train = load_dataset_split(
        script_args.dataset_name,
        script_args.dataset_train_split,
        num_samples=num_train,
        one_shot=script_args.one_shot,
        chat=chat,
        **common,
    )
    if getattr(training_args, "curriculum", False) and "task" not in train.column_names:
        raise ValueError(
            f"curriculum: true needs rows with a task (dataset_name: synthetic), not {script_args.dataset_name}"
        )
    eval_problems = []
    if script_args.eval_num_samples:
        # One held-out set whatever the training seed: seeds of a sweep are then compared on the same problems
        # (paired), and the cached "before" eval of the model on that set is reused across runs.
        rows = load_problems(
            script_args.dataset_name,
            script_args.dataset_test_split,
            script_args.eval_num_samples,
            **{**common, "seed": HELDOUT_SEED},
        )
        eval_problems = problems_from_rows(rows, one_shot=script_args.one_shot, chat=chat)
    return train, eval_problems


def peak_rss_gb() -> float:
    """Peak resident memory of this process and its finished children, in GB (Linux reports KiB).

    This process's own peak is its high-water mark since it started this program (``VmHWM``): getrusage's
    ``ru_maxrss`` also keeps the peak of the process it was forked from, up to the exec, so a run started by a large
    process (a bench holding models) would report that process's memory as its own."""
    self_kib = _own_peak_kib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(self_kib, child_kib) * 1024 / 1e9


def _own_peak_kib() -> int | None:
    """``VmHWM`` of /proc/self/status in KiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def summarize_metrics(rows: list[dict], window: int = 10) -> dict:
    """Mean reward of the first and last `window` logged steps (and their difference)."""
    rewards = [row["reward"] for row in rows if isinstance(row.get("reward"), (int, float))]
    if not rewards:
        return {"logged_steps": len(rows)}
    window = max(1, min(window, len(rewards) // 2 or 1))
    first, last = rewards[:window], rewards[-window:]
    zero_std = [
        row["frac_reward_zero_std"] for row in rows if isinstance(row.get("frac_reward_zero_std"), (int, float))
    ]
    out = {
        "logged_steps": len(rows),
        "window": window,
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        "frac_reward_zero_std_mean": sum(zero_std) / len(zero_std) if zero_std else None,
    }
    out["reward_gain"] = out["reward_last"] - out["reward_first"]
    return out


def save_run_config(trainer, script_args, training_args, model_args) -> None:
    """`<output_dir>/config.yaml` (main process): script, model and training arguments as the run used them, so
    `trl-grpo-ext compare` groups runs launched by hand, not only by `sweep`, that differ only in seed."""
    if not trainer.is_world_process_zero():
        return
    from dataclasses import asdict

    config = {**asdict(model_args), **asdict(script_args), **training_args.to_dict(), "backend": "trl"}
    write_run_config(training_args.output_dir, config)


def report_run(trainer, training_args) -> dict:
    """Write `<output_dir>/run_summary.json` (rewards first vs last, eval before/after, wall time, peak RSS) and print it."""
    if not trainer.is_world_process_zero():
        return {}
    out_dir = Path(training_args.output_dir)
    summary = summarize_metrics(run_metrics(out_dir))
    eval_path = out_dir / EVAL_BEFORE_AFTER_FILENAME
    if eval_path.exists():
        summary["eval"] = json.loads(eval_path.read_text())
        if "paired" in summary["eval"]:  # the paired held-out gains with their 95% intervals, at the top
            summary["heldout_gain"] = summary["eval"]["paired"]["metrics"]
    import torch

    governor = current_governor()
    summary["torch_threads"] = governor.cap if governor else torch.get_num_threads()
    if governor:  # the count followed the machine's load: how often, and how low
        summary["torch_threads_governor"] = {"changes": governor.changes, "lowest": governor.lowest}
    summary["precision"] = run_precision(training_args)
    summary["sampler"] = run_sampler(trainer, training_args)
    summary["sampling_mode"] = sampling_mode(training_args)
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    phase = next((cb for cb in callbacks if hasattr(cb, "interrupted")), None)
    if phase is not None and phase.seconds is not None:  # `callbacks.TrainingPhaseCallback`
        summary["training_phase_s"] = round(phase.seconds, 1)
    summary["wall_time_s"] = round(time.time() - _START, 1)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    summary["cpu_time_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    summary["peak_rss_gb"] = round(peak_rss_gb(), 2)
    atomic_write_json(out_dir / RUN_SUMMARY_FILENAME, summary, indent=2)
    lines = [f"run summary ({out_dir / RUN_SUMMARY_FILENAME}):"]
    if "reward_first" in summary:
        lines.append(
            f"  mean reward, first {summary['window']} logged steps: {summary['reward_first']:.3f}; "
            f"last {summary['window']}: {summary['reward_last']:.3f}"
        )
    lines += heldout_lines(summary.get("eval", {}))
    threads = f"{summary['torch_threads']} torch threads"
    if governor and governor.changes:
        threads += f", down to {governor.lowest} while other processes were busy"
    lines.append(
        f"  wall time {summary['wall_time_s']} s (CPU time {summary['cpu_time_s']} s, {threads}), "
        f"peak RSS {summary['peak_rss_gb']} GB"
    )
    if governor:  # the count changed: which figures may differ, how to repeat a run bit for bit
        lines += governor.summary_lines()
    print("\n".join(lines), file=sys.stdout, flush=True)
    return summary
