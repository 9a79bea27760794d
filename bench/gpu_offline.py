"""Offline GPU check: trl_grpo_ext.GRPOTrainer against trl.GRPOTrainer on a randomly initialised model of
Qwen2.5-0.5B-Instruct's shape (no download, no network), on the torch/transformers already installed.

1. Agreement, per loss type (TRL's and ours): loss and gradients of `trl_grpo_ext.GRPOTrainer` (prefix sharing on
   and off) against `trl.GRPOTrainer` on the same batch (our own losses against the TRL settings they equal:
   tests/test_trainer.py's pairs). Tolerance: how much TRL's own loss and gradients change when one padding column
   is added to the batch (left of the prompts, or right of the completions, whichever moves them more), measured in
   the same run on the same batch; never below a few units of the dtype's rounding.
2. Timing: training steps (generation with transformers' `generate`, scoring, log-prob forward/backward, AdamW) of
   vanilla TRL and ours with sharing on and off, at 8 prompts x 8 generations of 200-token prompts (150 tokens
   shared, like a system prompt and one-shot example) with 256- and 1,024-token completions, under `sdpa` and
   `flash_attention_2` when flash-attn is importable: step time, tokens/s, peak memory; which SDPA kernel ran.

Prints the tables, writes everything to `<out>/gpu_offline.json`, exits 1 if any check failed (2 on bad input).
`--dry-run` runs the same code on CPU at a tiny shape in float32 (what CI runs: bench/gpu_check.sh --offline
--dry-run); its figures say only that the code works.

    python bench/gpu_offline.py                      # on the GPU box (bench/gpu_check.sh --offline)
    python bench/gpu_offline.py --dry-run            # on CPU, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reads the hub; make sure nothing tries
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Qwen2.5-0.5B-Instruct's config.json, the fields that fix its shape and numerics (written by hand: no download).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
# The CPU dry run's shape: the same architecture, small enough for CI.
TINY = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip

# Our loss types against the TRL settings they equal (tests/test_trainer.py's EQUIVALENT).
OURS_VS_TRL = {
    "importance_sampling": ({"loss_type": "importance_sampling"}, {"loss_type": "dapo", "epsilon": 1.0, "epsilon_high": 1e9}),
    "cispo": ({"loss_type": "cispo", "cispo_clip_low": 0.0, "cispo_clip_high": 1.1}, {"loss_type": "cispo", "epsilon_high": 1.1}),
    "ppo": ({"loss_type": "ppo", "epsilon_high": 0.28}, {"loss_type": "dapo", "epsilon_high": 0.28}),
}  # fmt: skip
ROUNDING_UNITS = 8  # the tolerance's floor, in units of the dtype's epsilon (relative)
SDPA_KERNELS = {  # aten op -> name
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "mem_efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, float32, short completions")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_offline"), help="output folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--shared-tokens", type=int, default=150, help="prompt tokens all prompts share")
    parser.add_argument("--completion-lengths", default="256,1024", help="comma-separated")
    parser.add_argument("--agreement-completion", type=int, default=256, help="completion tokens of that batch")
    parser.add_argument("--steps", type=int, default=2, help="training steps per timing (the first is warm-up)")
    parser.add_argument("--attn", default="auto", help="'auto' (sdpa, + flash_attention_2 if importable) or a list")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.shape = "cpu", "float32", TINY
        if args.completion_lengths == "256,1024":
            args.completion_lengths = "16,32"
        if args.agreement_completion == 256:
            args.agreement_completion = 16
        if args.prompt_tokens == 200:
            args.prompt_tokens, args.shared_tokens = 24, 16
        if args.prompts == 8 and args.generations == 8:
            args.prompts, args.generations = 2, 4
    else:
        args.device, args.dtype, args.shape = "cuda", "bfloat16", QWEN25_05B
    try:
        args.lengths = [int(x) for x in args.completion_lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--completion-lengths {args.completion_lengths!r}: comma-separated integers")
    if not args.lengths or min(args.lengths) < 1 or args.agreement_completion < 2:
        parser.error("completion lengths must be >= 1, --agreement-completion >= 2")
    if not 0 <= args.shared_tokens < args.prompt_tokens:
        parser.error("--shared-tokens must be >= 0 and < --prompt-tokens")
    if min(args.prompts, args.generations) < 1 or args.generations < 2 or args.steps < 2:
        parser.error("--prompts >= 1, --generations >= 2 and --steps >= 2 (the first step is warm-up)")
    if args.attn == "auto":
        args.attn_list = ["sdpa"] + (["flash_attention_2"] if flash_attn_importable() and not args.dry_run else [])
    else:
        args.attn_list = [a for a in args.attn.split(",") if a]
    return args


def flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


# ------------------------------------------------------------------------------------ model, tokenizer, data


def write_model(folder: Path, shape: dict, dtype: str, seed: int) -> Path:
    """A randomly initialised model of `shape` and a word-level tokenizer ("t0" ... one token per id), saved."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, eos = f"t{shape['bos_token_id']}", f"t{shape['eos_token_id']}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    tokenizer.save_pretrained(folder)
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    config.architectures = shape["architectures"]
    config.pad_token_id = shape["eos_token_id"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = shape["eos_token_id"]
    model.generation_config.eos_token_id = shape["eos_token_id"]
    model.save_pretrained(folder)
    return folder


def prompts(args) -> list[str]:
    """`args.prompts` prompts of `args.prompt_tokens` tokens, the first `args.shared_tokens` the same in all."""
    import random

    rng = random.Random(args.seed)
    special = {args.shape["bos_token_id"], args.shape["eos_token_id"]}
    pool = [i for i in range(4, min(args.shape["vocab_size"], 5000)) if i not in special]
    shared = rng.choices(pool, k=args.shared_tokens)
    rows = [shared + rng.choices(pool, k=args.prompt_tokens - args.shared_tokens) for _ in range(args.prompts)]
    return [" ".join(f"t{i}" for i in row) for row in rows]


def token_reward(completion_ids, **kwargs):
    """A reward that varies within a group (a random model's completions nearly all run to the limit: a length
    reward would be flat)."""
    return [float(sum(ids) % 97) / 97.0 for ids in completion_ids]


def make_trainer(kind: str, model_path: Path, args, out: Path, attn: str, completion: int, **loss_kwargs):
    """`kind`: 'trl' (trl.GRPOTrainer) or 'ours' / 'ours_noshare' (trl_grpo_ext.GRPOTrainer, sharing on / off)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    import trl_grpo_ext

    common = dict(
        output_dir=str(out), report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        per_device_train_batch_size=args.prompts * args.generations, num_generations=args.generations,
        max_completion_length=completion, learning_rate=1e-6, beta=0.0, seed=args.seed, max_steps=args.steps,
        use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", temperature=1.0,
        model_init_kwargs={"dtype": getattr(torch, args.dtype), "attn_implementation": attn},
    )  # fmt: skip
    if kind == "trl":
        config = trl.GRPOConfig(**common, **loss_kwargs)
        cls = trl.GRPOTrainer
    else:
        sharing = {"share_prompt_prefix": kind == "ours"}
        config = trl_grpo_ext.GRPOConfig(**common, **sharing, **loss_kwargs)
        cls = trl_grpo_ext.GRPOTrainer
    data = Dataset.from_dict({"prompt": prompts(args)})
    trainer = cls(str(model_path), [token_reward], args=config, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # the tables say it; no log dict per step
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps  # read by _compute_loss
    return trainer


# ---------------------------------------------------------------------------------------------- agreement


def agreement_batch(trainer, args):
    """A scored generation batch with varied completion lengths, off-policy old log-probs and random advantages."""
    import torch

    torch.manual_seed(args.seed)
    rows = [{"prompt": p} for p in prompts(args) for _ in range(args.generations)]
    inputs = trainer._generate_and_score_completions(rows)
    g = torch.Generator().manual_seed(args.seed)
    mask = inputs["completion_mask"]
    lengths = torch.randint(1, mask.size(1) + 1, (mask.size(0),), generator=g)
    inputs["completion_mask"] = mask * (torch.arange(mask.size(1)) < lengths[:, None]).to(mask)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, mask.size(1))
    noise = torch.randn(logps.shape, generator=g).to(logps.device) * 0.3
    inputs["old_per_token_logps"] = (logps.float() + noise).to(logps.dtype)
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=g).to(inputs["advantages"].device)
    return inputs


def with_padding_column(inputs, pad_id: int, side: str):
    """The same batch with one more padding column: left of the prompts or right of the completions."""
    import torch

    out = dict(inputs)
    key, mask_key = ("prompt_ids", "prompt_mask") if side == "prompt" else ("completion_ids", "completion_mask")
    ids, mask = inputs[key], inputs[mask_key]
    col_ids = torch.full_like(ids[:, :1], pad_id)
    col_mask = torch.zeros_like(mask[:, :1])
    if side == "prompt":
        out[key], out[mask_key] = torch.cat([col_ids, ids], 1), torch.cat([col_mask, mask], 1)
    else:
        out[key], out[mask_key] = torch.cat([ids, col_ids], 1), torch.cat([mask, col_mask], 1)
        for name in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
            if inputs.get(name) is not None:
                out[name] = torch.cat([inputs[name], torch.zeros_like(inputs[name][:, :1])], 1)
    return out


def loss_and_grad(trainer, inputs, profile: bool = False):
    """(loss, flat fp32 gradient, SDPA kernels seen or None) of one `_compute_loss` forward/backward."""
    import torch

    model = trainer.model
    model.zero_grad(set_to_none=True)
    kernels = None
    ctx = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if profile
        else contextlib.nullcontext()
    )
    with ctx as prof:
        loss = trainer._compute_loss(model, dict(inputs))
        loss.backward()
    if profile:
        kernels = sorted({SDPA_KERNELS[e.key] for e in prof.key_averages() if e.key in SDPA_KERNELS})
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach().float().item(), grad, kernels


def release(args) -> None:
    """Free the last trainer's model and optimizer before the next one loads (trainers hold reference cycles)."""
    import gc

    import torch

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def agreement(model_path: Path, args, out: Path) -> list[dict]:
    """One row per loss type: TRL's loss/grad change from a padding column (the tolerance) and ours' difference."""
    import torch

    from trl_grpo_ext.trl.config import TRL_LOSS_TYPES

    eps = torch.finfo(getattr(torch, args.dtype)).eps
    cases = []
    for loss_type in TRL_LOSS_TYPES:
        kwargs = {"loss_type": loss_type, "epsilon_high": 0.28}
        if loss_type == "luspo":
            kwargs["importance_sampling_level"] = "sequence"
        ours = {**kwargs, "loss_type": "trl_cispo" if loss_type == "cispo" else loss_type}
        cases.append((loss_type, "trl", ours, kwargs))
    for loss_type, (ours, trl_kwargs) in OURS_VS_TRL.items():
        cases.append((loss_type, "ours", ours, trl_kwargs))
    rows, inputs = [], None
    for loss_type, family, ours_kwargs, trl_kwargs in cases:
        trl_trainer = make_trainer(
            "trl", model_path, args, out / "agreement", "sdpa", args.agreement_completion, **trl_kwargs
        )
        if inputs is None:
            inputs = agreement_batch(trl_trainer, args)
        pad_id = trl_trainer.processing_class.pad_token_id
        loss_ref, grad_ref, trl_kernels = loss_and_grad(trl_trainer, inputs, profile=not rows)
        pad_loss, pad_grad = 0.0, 0.0
        for side in ("prompt", "completion"):
            loss_pad, grad_pad, _ = loss_and_grad(trl_trainer, with_padding_column(inputs, pad_id, side))
            pad_loss, pad_grad = max(pad_loss, abs(loss_pad - loss_ref)), max(pad_grad, rel(grad_pad, grad_ref))
        tol_loss = max(pad_loss, ROUNDING_UNITS * eps * abs(loss_ref))
        tol_grad = max(pad_grad, ROUNDING_UNITS * eps)
        row = {"loss_type": loss_type, "family": family, "trl_settings": trl_kwargs, "loss_trl": loss_ref,
               "padding_column_loss_change": pad_loss, "padding_column_grad_change": pad_grad,
               "tolerance_loss": tol_loss, "tolerance_grad": tol_grad}  # fmt: skip
        del trl_trainer
        release(args)
        ok = True
        for kind in ("ours_noshare", "ours"):
            trainer = make_trainer(
                kind, model_path, args, out / "agreement", "sdpa", args.agreement_completion, **ours_kwargs
            )
            loss, grad, kernels = loss_and_grad(trainer, inputs, profile=not rows and kind == "ours")
            d_loss, d_grad = abs(loss - loss_ref), rel(grad, grad_ref)
            row[f"{kind}_loss_diff"], row[f"{kind}_grad_diff"] = d_loss, d_grad
            ok &= d_loss <= tol_loss and d_grad <= tol_grad
            if kernels is not None:
                row["sdpa_kernels"] = {"trl": trl_kernels, "ours (sharing)": kernels}
            del trainer
            release(args)
        row["ok"] = bool(ok)
        rows.append(row)
        release(args)
    return rows


# ------------------------------------------------------------------------------------------------- timing


def timing(model_path: Path, args, out: Path) -> list[dict]:
    """Training steps of vanilla TRL and ours (sharing on / off) per completion length and attention kernel."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def _sync(self):
            if torch.cuda.is_available() and args.device == "cuda":
                torch.cuda.synchronize()

        def on_step_begin(self, *a, **kw):
            self._sync()
            self._start = time.perf_counter()

        def on_step_end(self, *a, **kw):
            self._sync()
            self.times.append(time.perf_counter() - self._start)

    rows = []
    for attn in args.attn_list:
        for completion in args.lengths:
            for kind in ("trl", "ours", "ours_noshare"):
                trainer = make_trainer(kind, model_path, args, out / "timing", attn, completion, loss_type="dapo")
                times = StepTimes()
                trainer.add_callback(times)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                result = trainer.train()
                logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
                mean_len = statistics.mean(h["completions/mean_length"] for h in logs[1:] or logs)
                step = statistics.median(times.times[1:])
                tokens = args.prompts * args.generations * (args.prompt_tokens + mean_len)
                rows.append({
                    "attn": attn, "completion_tokens": completion, "trainer": kind, "steps": len(times.times),
                    "step_s": step, "first_step_s": times.times[0], "tokens_per_s": tokens / step,
                    "completion_mean_length": mean_len, "train_loss": result.training_loss,
                    "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
                })  # fmt: skip
                del trainer
                release(args)
    return rows


# ------------------------------------------------------------------------------------------------- report


def environment(args) -> dict:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    import trl_grpo_ext

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "accelerate": accelerate.__version__, "peft": peft.__version__,
           "trl_grpo_ext": trl_grpo_ext.__version__, "device": args.device, "dtype": args.dtype,
           "flash_attn_importable": flash_attn_importable()}  # fmt: skip
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["sdpa_backends_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled(),
        }  # fmt: skip
    return env


def format_report(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"gpu_offline: {env.get('gpu', env['device'])}, {env['dtype']}; torch {env['torch']}, transformers "
        f"{env['transformers']}, trl {env['trl']}, accelerate {env['accelerate']}, peft {env['peft']}",
        f"gpu_offline: model: {report['model']}",
        "agreement (|loss diff|, relative grad diff; tolerance = TRL's own change from one padding column):",
        f"  {'loss type':27s} {'loss (TRL)':>11s} {'tol loss':>9s} {'ours':>9s} {'ours+share':>10s} "
        f"{'tol grad':>9s} {'ours':>9s} {'ours+share':>10s}  result",
    ]
    for r in report["agreement"]:
        name = f"{r['loss_type']} ({r['family']})"
        lines.append(
            f"  {name:27s} {r['loss_trl']:11.4g} {r['tolerance_loss']:9.2e} {r['ours_noshare_loss_diff']:9.2e} "
            f"{r['ours_loss_diff']:10.2e} {r['tolerance_grad']:9.2e} {r['ours_noshare_grad_diff']:9.2e} "
            f"{r['ours_grad_diff']:10.2e}  {'ok' if r['ok'] else 'FAILED'}"
        )
    kernels = next((r["sdpa_kernels"] for r in report["agreement"] if "sdpa_kernels" in r), {})
    lines.append(f"SDPA kernels that ran (training forward/backward): {kernels}")
    lines.append(
        f"timing ({report['batch']}; step time median after the first step):"
        f"\n  {'attn':18s} {'completion':>10s} {'trainer':13s} {'step s':>8s} {'tokens/s':>10s} {'peak GiB':>9s} {'vs TRL':>7s}"
    )
    base = {(r["attn"], r["completion_tokens"]): r["step_s"] for r in report["timing"] if r["trainer"] == "trl"}
    for r in report["timing"]:
        mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        trl_step = base.get((r["attn"], r["completion_tokens"]))
        speed = "n/a" if trl_step is None else f"{trl_step / r['step_s']:.2f}x"
        lines.append(
            f"  {r['attn']:18s} {r['completion_tokens']:10d} {r['trainer']:13s} {r['step_s']:8.3f} "
            f"{r['tokens_per_s']:10,.0f} {mem:>9s} {speed:>7s}"
        )
    for failure in report["failures"]:
        lines.append(f"gpu_offline: FAILED: {failure}")
    lines.append(f"gpu_offline: {'all checks passed' if not report['failures'] else 'CHECKS FAILED'}")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_offline: error: no CUDA GPU is visible to torch (--dry-run runs on CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = {"environment": environment(args), "failures": [], "agreement": [], "timing": []}
    report["batch"] = (f"{args.prompts} prompts x {args.generations} generations, {args.prompt_tokens}-token prompts "
                       f"({args.shared_tokens} shared)")  # fmt: skip
    shape = args.shape
    report["model"] = (f"random {shape['model_type']} (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
                       f"layers, {shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocab "
                       f"{shape['vocab_size']})")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_path = write_model(Path(tmp) / "model", shape, args.dtype, args.seed)
        for name, phase in (("agreement", agreement), ("timing", timing)):
            phase_start = time.perf_counter()
            try:
                report[name] = phase(model_path, args, Path(tmp))
            except Exception as e:  # a phase that crashes is a failed check; the next phase still runs
                report["failures"].append(f"{name}: {type(e).__name__}: {e}")
            print(f"gpu_offline: {name} took {time.perf_counter() - phase_start:.0f} s", flush=True)
    report["failures"] += [
        f"agreement: {r['loss_type']} ({r['family']}) outside tolerance" for r in report["agreement"] if not r["ok"]
    ]
    report["wall_s"] = time.perf_counter() - start
    (out / "gpu_offline.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    print(f"gpu_offline: figures in {out / 'gpu_offline.json'} ({report['wall_s']:.0f} s)")
    return 1 if report["failures"] else 0


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars, once per trainer (the script's process only)
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
