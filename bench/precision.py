"""bf16 where the CPU has the units: step times, decode against its bounds, and the sampler mismatch.

1. Steps: ``bench/step_time.py``'s alternated vanilla-TRL / ours runs of the embedded recipe (G=4 and G=8) in fp32
   (``--bf16 false``) and in bf16 (the recipe's ``bf16: auto`` where the CPU has bf16 matrix units; vanilla TRL
   gets the same ``bf16``), with their phases and the compute bound at the bf16 matmul rate.
2. Decode: ms per new token at 12 and 24 rows (the recipe's generation batch is 24 rows), fp32 and bf16 (one
   autocast region around ``generate``, as the samplers run it; and, for comparison, a bf16 copy of the weights),
   against the weight-read bound (bytes of weights one decode step reads / measured memory bandwidth) and the
   python/dispatch floor (the same architecture with tiny widths: its step is all overhead).
3. Mismatch: one generation batch of our trainer with the bf16 sampler against the trainer's log-probs:
   sampler-vs-trainer KL, the raw importance ratio's mean/min/max, the fraction the correction truncates.
4. Memory: the embedded recipe as ``make train`` runs it (``--memory-steps`` steps, ``--memory-eval`` held-out
   problems evaluated before and after, one thread, each precision in a process of its own, one after the other):
   ``peak RSS: fp32 <a> GB, bf16 <b> GB`` from each run's ``run_summary.json``.

A CPU without bf16 units emulates bf16 (its large matmuls 30-60x slower than fp32 on AVX2), so there the bf16 rows are skipped
unless ``--quick`` (tiny random model, forced bf16: the mismatch and code paths, not speeds) and the figures that
need them print ``n/a``; the run says so.

Last line: ``precision: make-train step bf16/fp32 <x>, decode <y>x the weight-read bound (12 rows), step <z>x the
bf16 compute bound`` (x, z: ours at G=4; y: the recipe's auto precision). Targets: x <= 0.55, y <= 2.0.

Run on an idle machine: ``python bench/precision.py`` (tens of minutes on 2 cores); ``--quick`` (< 2 minutes);
``--memory-only``: part 4 alone (a few minutes).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from step_time import (  # noqa: E402
    PINNED_BATCH,
    build_trainer,
    fastest_rate,
    group_configs,
    measure_rates,
    report,
    run_precisions,
)

ROWS = (12, 24)


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write), best of `repeats`."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def weight_bytes(model, bytes_per_weight: int) -> int:
    """Bytes one decode step reads: every linear weight (the output layer included), in the sampler's dtype."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * bytes_per_weight


def decode_ms_per_token(model, rows: int, new_tokens: int, mode: str, prompt_len: int = 120) -> float:
    """ms per decode step at `rows` rows: (generate of 1 + n tokens - generate of 1 token) / n, best of 2; with the
    attention wrapper the samplers install (`trl_grpo_ext.cpu.decode_attention`)."""
    from trl_grpo_ext.cpu.precision import bf16_autocast
    from trl_grpo_ext.prefix.attention import install

    install()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size - 1, (rows, prompt_len), generator=g)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n):
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            with torch.no_grad(), bf16_autocast(mode == "bf16 autocast"):
                model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            best = min(best, time.perf_counter() - start)
        return best

    return (timed(1 + new_tokens) - timed(1)) / new_tokens * 1e3


def floor_model(model):
    """The same architecture (layers, heads) with tiny widths: a decode step of it is python and dispatch only."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    heads = config.num_attention_heads
    config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size = heads * 8, 8, 32, 256
    return AutoModelForCausalLM.from_config(config).eval()


def decode_figures(model_path: str, new_tokens: int, precisions: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    floor = floor_model(model)
    bandwidth = memory_bandwidth()
    print(f"\n== decode ==\nmemory bandwidth {bandwidth / 1e9:.1f} GB/s (copy, best of 5)")
    out = {}
    for rows in ROWS:
        floor_ms = decode_ms_per_token(floor, rows, new_tokens, "fp32")
        for mode in precisions:
            if mode == "bf16 weights":
                measured = decode_ms_per_token(model.to(torch.bfloat16), rows, new_tokens, "bf16 weights")
                model.to(torch.float32)
            else:
                measured = decode_ms_per_token(model, rows, new_tokens, mode)
            bound = weight_bytes(model, 4 if mode == "fp32" else 2) / bandwidth * 1e3
            out[(rows, mode)] = (measured, bound, floor_ms)
            print(
                f"{rows:>3} rows, {mode:<14}: {measured:7.2f} ms/token; weight-read bound {bound:6.2f} ms "
                f"({measured / bound:.2f}x); dispatch floor {floor_ms:.2f} ms"
            )
    return out


def mismatch_figures(model_path_overrides: list[str], rows: int = 24) -> dict:
    """One generation batch of our trainer with the bf16 sampler, against the trainer's log-probs (autocast)."""
    import trl

    import trl_grpo_ext
    from trl_grpo_ext.grpo.losses import sampler_correction

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(trl_grpo_ext.GRPOTrainer, [*model_path_overrides, "--bf16", "true"], Path(tmp))
        trainer.model.train()
        group = trainer.num_generations
        batch = [trainer.train_dataset[i] for i in range(rows // group) for _ in range(group)]
        torch.manual_seed(0)
        inputs = trainer._generate_and_score_completions(batch)
        mask = inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], mask], 1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, trainer.model, ids, attn, mask.size(1)
            )
        args = trainer.args
        figures = {}
        for mode in ("token_truncate", args.vllm_importance_sampling_mode):
            _, metrics = sampler_correction(
                logps,
                inputs["sampling_per_token_logps"],
                mask,
                mode,
                args.vllm_importance_sampling_clip_min,
                args.vllm_importance_sampling_clip_max,
            )
            figures[mode] = {k.split("sampling/")[1]: float(v) for k, v in metrics.items()}
    print(
        f"\n== sampler / trainer mismatch (bf16 sampler, {rows} rows, cap {args.vllm_importance_sampling_clip_max}) =="
    )
    for mode, values in figures.items():
        print(f"{mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    return figures


def memory_figures(precisions: list[str], steps: int, eval_problems: int, overrides: list[str]) -> dict:
    """Peak RSS (GB) of the embedded recipe run by itself in each precision ("fp32", "bf16"): `steps` optimizer
    steps and the before/after eval of `eval_problems` problems, one torch thread, the eval cache off."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    peaks = {}
    for name in precisions:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_GRPO_EXT_CPU_THREADS": "fixed"}
            env["TRL_GRPO_EXT_CACHE"] = str(Path(tmp) / "cache")  # the "before" eval generated, not read
            command = [sys.executable, str(root / "recipes" / "gsm8k_grpo.py")]
            command += ["--config", str(root / "recipes" / "gsm8k" / "embedded.yaml"), *overrides]
            command += ["--max_steps", str(steps), "--eval_num_samples", str(eval_problems)]
            command += ["--bf16", "true" if name == "bf16" else "false", "--output_dir", str(Path(tmp) / "run")]
            command += ["--disable_tqdm", "true"]
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peaks[name] = json.loads((Path(tmp) / "run" / "run_summary.json").read_text())["peak_rss_gb"]
    print(
        f"\n== memory (embedded recipe, {steps} steps, {eval_problems} held-out problems before and after, 1 thread) =="
        "\npeak RSS: " + ", ".join(f"{name} {gb:.2f} GB" for name, gb in peaks.items())
    )
    return peaks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trainer and config (plus a warm-up)")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per measurement")
    parser.add_argument("--quick", action="store_true", help="tiny random model, forced bf16: a smoke test (< 2 min)")
    parser.add_argument("--memory-steps", type=int, default=4, help="optimizer steps of each memory run")
    parser.add_argument("--memory-eval", type=int, default=64, help="held-out problems of each memory run")
    parser.add_argument("--memory-only", action="store_true", help="only the memory runs (part 4): a few minutes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    from trl_grpo_ext.cpu.precision import cpu_bf16_units
    from trl_grpo_ext.models import resolve_model

    units, why = cpu_bf16_units()
    print(f"torch threads: {torch.get_num_threads()}; bf16 matrix units: {'yes' if units else 'NO'} ({why})")
    base = list(PINNED_BATCH)
    if args.quick:
        from conftest import build_tiny_model

        model_path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        base += ["--model_name_or_path", model_path, "--max_completion_length", "8"]
        args.steps, args.new_tokens = 1, 4
    else:
        model_path = resolve_model("embedded")
    run_bf16 = units or args.quick
    if not units:
        print(
            "this CPU has no bf16 matrix units: torch emulates bf16 (large matmuls 30-60x slower than fp32), so `bf16: "
            "auto` is fp32 and "
            + (
                "the bf16 rows below are forced on the tiny model: code paths and mismatch only, not speed"
                if args.quick
                else "the bf16 rows are skipped (their figures print n/a); run on a bf16-capable CPU for them"
            )
        )
    memory_overrides = ["--model_name_or_path", model_path, "--max_completion_length", "8"] if args.quick else []
    if args.quick:
        args.memory_steps, args.memory_eval = 1, 4
    memory_precisions = ["fp32", "bf16"] if run_bf16 else ["fp32"]
    if args.memory_only:
        memory_figures(memory_precisions, args.memory_steps, args.memory_eval, memory_overrides)
        return
    rates = {"fp32": [], "bf16": []}
    measure_rates(rates, 1.0)
    precisions = [("fp32", ["--bf16", "false"])] + ([("bf16", ["--bf16", "true"])] if run_bf16 else [])
    results = run_precisions(precisions, group_configs(base, "G=4", "G=8"), args.steps, rates)
    for name, values in rates.items():
        print(f"{name} matmul rate: {max(values) / 1e9:.1f} GFLOP/s (best of {len(values)})")
    bf16_rate = max(rates["bf16"])
    for key, result in results.items():  # each row against the bound of its own precision's matmul rate
        report(result, bf16_rate if key[0] == "bf16" else max(rates["fp32"]))
    print(f"(fastest matmul rate: {fastest_rate(rates)[1]})")
    step = {key: r["phases"]["ours"]["total"] for key, r in results.items()}  # medians of the timed steps
    x = step[("bf16", "G=4")] / step[("fp32", "G=4")] if run_bf16 else None
    z = step[("bf16", "G=4")] / (results[("bf16", "G=4")]["flops"]["ours"] / bf16_rate) if run_bf16 else None

    modes = ["fp32"] + (["bf16 autocast", "bf16 weights"] if run_bf16 else [])
    decode = decode_figures(model_path, args.new_tokens, modes)
    auto_mode = "bf16 autocast" if units else "fp32"
    measured, bound, _ = decode[(12, auto_mode)]
    y = measured / bound
    print(f"decode at 12 rows in the auto precision ({auto_mode}): {y:.2f}x the weight-read bound")
    if run_bf16:
        mismatch_figures(base if args.quick else [])
    else:
        print("\nmismatch: skipped (no bf16 units: a bf16 generation batch of the embedded model is emulated)")

    memory_figures(memory_precisions, args.memory_steps, args.memory_eval, memory_overrides)

    def fmt(value):
        return "n/a" if value is None else f"{value:.2f}"

    print(
        f"\nprecision: make-train step bf16/fp32 {fmt(x)}, decode {y:.2f}x the weight-read bound (12 rows), "
        f"step {fmt(z)}x the bf16 compute bound"
    )


if __name__ == "__main__":
    main()
