"""The sampler on the CPU: transformers' ``generate`` (as the recipe runs it: fp32, and the auto precision's bf16
autocast where the CPU has bf16 units) against vLLM's CPU build, in ms per decode step at 12, 24 and 48 rows,
each against the weight-read bound (bytes of weights one decode step reads / measured copy bandwidth, in the
sampler's dtype) and the dispatch floor (``generate`` on the same architecture with tiny widths).

Method, for every sampler alike: greedy, a 120-token random prompt per row, ``(t(1 + n new tokens) - t(1)) / n``,
best of 2; the samplers alternate row count by row count, so a load change on the machine hits them alike. vLLM
runs the model folder's weights in bf16 (``dtype=bfloat16``; fp32 where the CPU has no bf16 units), eager, in
this process (``LLM(...)`` loads in about a minute on 2 cores).

Last line: ``sampler: decode <a>x the weight-read bound (12 rows, vllm), <b>x (generate)`` (b: the auto precision).
The embedded recipe's whole step with each sampler is not measured here: compare ``make train`` runs of
recipes/gsm8k/embedded.yaml and recipes/gsm8k/embedded_vllm.yaml (their ``step_time`` in metrics.jsonl).

Run on an idle machine, with vLLM installed (``make install-vllmcpu``): ``.venv-vllmcpu/bin/python bench/sampler.py``;
``--quick``: a tiny random model, 4 tokens, rows 2 and 4 (the code paths, not speeds).
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROWS = (12, 24, 48)
PROMPT_LEN = 120


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per measurement")
    parser.add_argument("--quick", action="store_true", help="tiny random model: the code paths, not speeds")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import torch
    from precision import decode_ms_per_token, floor_model, memory_bandwidth, weight_bytes
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext.models import resolve_model
    from trl_grpo_ext.precision import cpu_bf16_units
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
    print(f"\nsampler: decode {a:.2f}x the weight-read bound ({first} rows, vllm), {b:.2f}x (generate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
