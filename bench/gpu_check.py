"""GPU check: GRPO-LoRA on GSM8K with colocated vLLM for a fixed number of steps, GSM8K test accuracy before/after.

Called by `bench/gpu_check.sh` (which installs the `[vllm]` extra first). Prints step time, generation tokens/s,
peak GPU memory and accuracy, and writes them to `<out>/gpu_check.json`. `--dry-run` checks everything that needs
no GPU -- the recipe parses with the overrides, the data is there and its answers parse, the model is a hub id or
a model folder -- and prints the commands it would run.

    python bench/gpu_check.py --dry-run
    python bench/gpu_check.py --model /models/Qwen2.5-0.5B-Instruct --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "gsm8k" / "gpu_colocate.yaml"
DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "gsm8k"
GENERATION_LOG = "gpu_check_generation.jsonl"  # one row per vLLM generate call, written by the training process
TRAIN_STATS = "gpu_check_train.json"
NVIDIA_SMI_LOG = "nvidia_smi_memory.csv"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id (needs the hub or its cache) or a model folder")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="folder with GSM8K train.jsonl and test.jsonl")
    parser.add_argument("--recipe", default=str(RECIPE), help="a colocated-vLLM recipe")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (fixed: the check is sized by work)")
    parser.add_argument("--eval-limit", type=int, default=200, help="GSM8K test problems evaluated before and after")
    parser.add_argument("--eval-batch-size", type=int, default=200, help="problems per generate() call in the eval")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="output folder")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the commands; needs no GPU")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.eval_limit < 1 or args.eval_batch_size < 1:
        parser.error("--eval-limit and --eval-batch-size must be >= 1")
    return args


# ----------------------------------------------------------------------------------------- commands


def train_argv(args) -> list[str]:
    """Recipe flags: the GPU recipe with this check's model, data, step count and output; no in-run eval or saves."""
    return [
        "--config", args.recipe, "--model_name_or_path", args.model, "--dataset_name", args.data,
        "--output_dir", str(Path(args.out) / "train"), "--max_steps", str(args.steps),
        "--warmup_steps", "0", "--eval_num_samples", "0", "--save_strategy", "no", "--report_to", "none",
    ]  # fmt: skip


def train_command(args) -> list[str]:
    # One process on one GPU; TRL's colocate mode sets the rank variables vLLM needs itself.
    return [sys.executable, str(Path(__file__).resolve()), "_train", "--out", args.out, "--", *train_argv(args)]


def eval_command(args) -> list[str]:
    """`trl-grpo-ext eval`: the base model (before) and base + the trained adapter (after) on the same problems."""
    return [
        sys.executable, "-m", "trl_grpo_ext.cli", "eval", "--model", args.model,
        "--adapter", str(Path(args.out) / "train"), "--compare_model", args.model, "--data", args.data,
        "--limit", str(args.eval_limit), "--batch_size", str(args.eval_batch_size), "--max_new_tokens", "512",
        "--out", str(Path(args.out) / "eval.jsonl"), "--no-progress",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------- preflight


def preflight(args) -> list[str]:
    """Everything checkable without a GPU; raises ValueError with a one-line reason. Returns notes to print."""
    from trl_grpo_ext.task.data import load_problems
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    notes = []
    data = Path(args.data)
    for split in ("train", "test"):
        if not (data / f"{split}.jsonl").is_file():
            raise ValueError(f"--data {data}: no {split}.jsonl (expected GSM8K's train.jsonl and test.jsonl)")
    test = load_problems(str(data), "test", args.eval_limit)
    if len(test) < args.eval_limit:
        raise ValueError(
            f"--data {data}: test.jsonl has {len(test)} problems, --eval-limit asks for {args.eval_limit}"
        )
    train = load_problems(str(data), "train")
    notes.append(f"data: {len(train)} train problems, {len(test)} test problems evaluated ({data})")

    model = Path(args.model)
    if model.exists():
        if not (model / "config.json").is_file():
            raise ValueError(f"--model {model}: a folder without config.json is not a model folder")
        notes.append(f"model: local folder {model}")
    elif args.model.startswith((".", "/", "~")) or args.model.count("/") != 1:
        raise ValueError(f"--model {args.model}: neither a model folder nor a hub id (org/name)")
    else:
        notes.append(f"model: hub id {args.model} (downloaded on first use: needs the hub, or its files in HF_HOME)")

    # The recipe as the training process will parse it (on CPU here: bf16 is checked on the GPU).
    overrides = ["--use_cpu", "true", "--bf16", "false"] if args.dry_run else []
    script_args, training_args, model_args = parse_recipe_args(train_argv(args) + overrides)
    if not training_args.use_vllm or training_args.vllm_mode != "colocate":
        raise ValueError(
            f"--recipe {args.recipe}: the check measures colocated vLLM (use_vllm: true, vllm_mode: colocate)"
        )
    per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    notes.append(
        f"recipe: {Path(args.recipe).name}, loss_type {training_args.loss_type}, {per_step // training_args.num_generations} "
        f"prompts x {training_args.num_generations} completions per step, max_completion_length "
        f"{training_args.max_completion_length}, LoRA r={model_args.lora_r}, vllm_gpu_memory_utilization "
        f"{training_args.vllm_gpu_memory_utilization}, IS correction {training_args.vllm_importance_sampling_mode}"
    )
    from trl_grpo_ext.cli import evaluate

    eval_parser = argparse.ArgumentParser(prog="trl-grpo-ext eval", exit_on_error=False)
    evaluate.add_arguments(eval_parser)
    cmd = eval_command(args)
    eval_args, unknown = eval_parser.parse_known_args(cmd[cmd.index("eval") + 1 :])
    if unknown:
        raise ValueError(f"trl-grpo-ext eval does not take {' '.join(unknown)}")
    notes.append(f"eval: {eval_args.limit} problems, base model vs base + adapter, batch {eval_args.batch_size}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {out} is not writable")
    return notes


def gpu_ready() -> str | None:
    """None when a CUDA GPU and vLLM are usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vllm is not importable ({e}); install the extra: pip install -e '.[vllm]'"
    return None


# ----------------------------------------------------------------------------------- training process


def train_in_process(out: str, recipe_argv: list[str]) -> int:
    """Run recipes/gsm8k_grpo.py's `main`, timing every vLLM generate call and recording peak GPU memory; returns
    `main`'s exit status (non-zero: a config or data error, nothing trained, no figures written)."""
    import importlib.util

    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    log_path = Path(out) / GENERATION_LOG
    log_path.unlink(missing_ok=True)
    generate = VLLMGeneration.generate

    def timed_generate(self, *a, **kw):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate(self, *a, **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for ids in result[1])  # (prompt_ids, completion_ids, logprobs, extra)
        with open(log_path, "a") as handle:
            handle.write(json.dumps({"completion_tokens": tokens, "seconds": seconds}) + "\n")
        return result

    VLLMGeneration.generate = timed_generate  # measurement only: same call, same result
    spec = importlib.util.spec_from_file_location("gsm8k_grpo", ROOT / "recipes" / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    status = module.main(recipe_argv)
    if status:
        return status
    stats = {
        "train_wall_s": time.perf_counter() - start,
        "torch_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "torch_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "gpu": torch.cuda.get_device_name(0),
    }
    (Path(out) / TRAIN_STATS).write_text(json.dumps(stats, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- report


def summarize(out: str) -> dict:
    """The figures the check prints, from the files the training and eval processes wrote."""
    from trl_grpo_ext.runs import run_metrics

    out = Path(out)
    rows = run_metrics(out / "train")
    step_times = [r["step_time"] for r in rows if isinstance(r.get("step_time"), (int, float))]
    calls = [json.loads(line) for line in (out / GENERATION_LOG).read_text().splitlines() if line.strip()]
    train = json.loads((out / TRAIN_STATS).read_text())
    evals = json.loads((out / "eval_summary.json").read_text())
    smi = (
        [float(x) for x in (out / NVIDIA_SMI_LOG).read_text().split() if x.replace(".", "", 1).isdigit()]
        if (out / NVIDIA_SMI_LOG).exists()
        else []
    )
    steady = step_times[1:] or step_times  # step 1 includes vLLM's first-call warm-up
    warm_calls = calls[1:] or calls
    return {
        "gpu": train["gpu"],
        "steps": len(rows),
        "step_time_first_s": step_times[0] if step_times else None,
        "step_time_median_s": statistics.median(steady) if steady else None,
        "generation_tokens_per_s": sum(c["completion_tokens"] for c in warm_calls)
        / sum(c["seconds"] for c in warm_calls)
        if warm_calls
        else None,
        "generation_calls": len(calls),
        "train_wall_s": train["train_wall_s"],
        "peak_gpu_memory_gib_torch_reserved": train["torch_peak_reserved_gib"],
        "peak_gpu_memory_gib_nvidia_smi": max(smi) / 1024 if smi else None,  # MiB
        "reward_first": rows[0].get("reward") if rows else None,
        "reward_last": rows[-1].get("reward") if rows else None,
        "accuracy_before": evals["compare_summary"]["pass@1"],
        "accuracy_after": evals["summary"]["pass@1"],
        "eval_problems": evals["summary"]["n"],
    }


def format_report(report: dict) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    return "\n".join([
        f"GPU check on {report['gpu']}: {report['steps']} GRPO-LoRA steps with colocated vLLM",
        f"  step time: {num(report['step_time_median_s'], '.2f')} s median (first step {num(report['step_time_first_s'], '.2f')} s)",
        f"  generation: {num(report['generation_tokens_per_s'], ',.0f')} completion tokens/s (vLLM, {report['generation_calls']} calls, first excluded)",
        f"  peak GPU memory: {num(report['peak_gpu_memory_gib_nvidia_smi'], '.1f')} GiB (nvidia-smi), "
        f"{num(report['peak_gpu_memory_gib_torch_reserved'], '.1f')} GiB reserved by torch in the training process",
        f"  reward: {num(report['reward_first'], '.3f')} (step 1) -> {num(report['reward_last'], '.3f')} (step {report['steps']})",
        f"  GSM8K test greedy accuracy ({report['eval_problems']} problems): {report['accuracy_before']:.3f} before -> "
        f"{report['accuracy_after']:.3f} after",
    ])  # fmt: skip


def run(args) -> int:
    try:
        notes = preflight(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"gpu_check: {note}")
    commands = [("train", train_command(args)), ("eval", eval_command(args))]
    if args.dry_run:
        for name, cmd in commands:
            print(f"gpu_check: would run ({name}): {shlex.join(cmd)}")
        reason = gpu_ready()
        print(f"gpu_check: GPU here: {'ready' if reason is None else reason}")
        print("gpu_check: dry run OK")
        return 0
    reason = gpu_ready()
    if reason is not None:
        print(f"gpu_check: error: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    smi_log = open(out / NVIDIA_SMI_LOG, "w")  # noqa: SIM115 -- held for the poller's lifetime
    try:
        poller = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500"], stdout=smi_log
        )
    except FileNotFoundError:
        poller = None
    try:
        for name, cmd in commands:
            print(f"gpu_check: running ({name}): {shlex.join(cmd)}", flush=True)
            start = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT)
            print(f"gpu_check: {name} took {time.perf_counter() - start:.0f} s", flush=True)
    except subprocess.CalledProcessError as e:  # the first failed step ends the check with its exit status
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return e.returncode or 1
    finally:
        if poller is not None:
            poller.terminate()
            poller.wait()
        smi_log.close()
    report = summarize(args.out)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    print(f"gpu_check: figures in {out / 'gpu_check.json'}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_train"]:  # the training process (train_command)
        sub = argparse.ArgumentParser()
        sub.add_argument("--out", required=True)
        known, rest = sub.parse_known_args(argv[1:])
        return train_in_process(known.out, rest[1:] if rest[:1] == ["--"] else rest)
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
