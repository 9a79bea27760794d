"""Decode speed against the machine's bound: transformers' ``generate`` and the packed engine (`trl_grpo_ext.decode`).

Three measurements, each side by side in one run (run it on an idle machine):

1. **A decode step** of the embedded model (SmolLM2-135M) at 12, 24 and 48 rows, a 120-token prompt per row, greedy:
   the median interval between successive steps' logits processor calls (a clock processor; the prompt's prefill
   left out), through ``generate`` with the attention wrapper the samplers install, and through the packed engine,
   alternated twice. Each beside the bound ``max(weights / copy bandwidth, 2 x parameters x rows / matmul rate)``
   with the copy bandwidth (a 256 MB copy) and the fp32 matmul rate (2048^3) measured in the same run. In fp32, and
   in the precision ``bf16: auto`` picks on this CPU (where that is fp32: the same rows, said so).
2. **The embedded recipe's sampling** (``--sampling-steps``, on-policy, no eval): two trainers, ``decode_engine:
   generate`` and ``packed``, taking turns step by step from the same seed (`bench/step_time.py`'s harness): the
   median seconds of ``_generate_single_turn`` per step, the first step left out.
3. **``trl-grpo-ext eval``'s greedy pass** over ``--eval`` held-out problems (its generator, batches of 8, the
   recipe's 256 new tokens), generate then packed, twice: seconds, and how many completions differ (a near tie
   resolved the other way by the engine's rounding).

Last line: ``decode: 12 rows <a>x, 24 rows <b>x, 48 rows <c>x the bound (<precision>); sampling new/old <s>; eval
new/old <e>``. Targets: a <= 2.5, b <= 2.0, c <= 2.0 in fp32; s <= 0.6; e <= 0.6. ``--quick``: the tiny random
model, few tokens and steps (a smoke test; numbers meaningless).

    python bench/decode.py                 # ~25 min on 2 CPU cores
    python bench/decode.py --eval 320      # the whole held-out set (longer)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision import memory_bandwidth, weight_bytes  # noqa: E402
from step_time import ROOT, StepClock, Turns, build_trainer, heldout_eval, train_in_turns  # noqa: E402

ROWS = (12, 24, 48)
PROMPT_TOKENS = 120


def matmul_rate(size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of a (size x size) fp32 product, best of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


class Clock:
    """A logits processor that notes when each decode step's logits arrive (it changes nothing)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def step_ms(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times[:-1], self.times[1:], strict=True)) * 1e3


def step_ms(model, engine: str, rows: int, new_tokens: int, bf16: bool) -> tuple[float, torch.Tensor]:
    """Median ms per decode step of `engine` at `rows` rows, and the tokens it generated."""
    from transformers import GenerationConfig, LogitsProcessorList

    from trl_grpo_ext.cpu.precision import bf16_autocast
    from trl_grpo_ext.decode import decode

    vocab = model.config.vocab_size
    ids = torch.randint(5, vocab - 1, (rows, PROMPT_TOKENS), generator=torch.Generator().manual_seed(rows))
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    clock = Clock()
    with torch.no_grad(), bf16_autocast(bf16, "cpu"):
        out = decode(
            model,
            engine,
            ids,
            torch.ones_like(ids),
            generation_config=config,
            logits_processor=LogitsProcessorList([clock]),
        )
    return clock.step_ms(), out


def decode_table(model_path: str, new_tokens: int, precisions: list[tuple[str, bool]]) -> dict:
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext.prefix.attention import install

    install()  # the attention wrapper the samplers install (bf16 decode attention as one packed call)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    bandwidth, rate = memory_bandwidth(), matmul_rate()
    nbytes = weight_bytes(model, 4)
    params = nbytes // 4
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; fp32 matmul (2048^3) {rate / 1e9:.1f} GFLOP/s")
    print(f"weights read per step {nbytes / 1e6:.0f} MB ({params / 1e6:.1f} M parameters in linear layers)")
    print(
        "| precision | rows | bound (ms) | generate (ms) | packed (ms) | generate / bound | packed / bound | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = {}
    for label, bf16 in precisions:
        for rows in ROWS:
            bound = max(nbytes / bandwidth, 2 * params * rows / rate) * 1e3
            times: dict[str, list[float]] = {"generate": [], "packed": []}
            outs = {}
            for engine in ("generate", "packed", "generate", "packed"):
                ms, outs[engine] = step_ms(model, engine, rows, new_tokens, bf16)
                times[engine].append(ms)
            old, new = min(times["generate"]), min(times["packed"])
            same = torch.equal(outs["generate"], outs["packed"])
            ratios[(label, rows)] = new / bound
            print(
                f"| {label} | {rows} | {bound:.1f} | {old:.1f} | {new:.1f} | {old / bound:.2f} | {new / bound:.2f} | "
                f"{'yes' if same else 'no'} |",
                flush=True,
            )
    return ratios


def sampling_seconds(overrides: list[str], steps: int) -> dict[str, float]:
    """Median sampling seconds per step of the recipe with each engine, the two trainers taking turns."""
    import trl_grpo_ext

    base = [*overrides, "--async_sampling", "false", "--max_steps", str(steps + 1), "--logging_steps", "1000"]
    base += ["--report_to", "none"]
    names = ("generate", "packed")
    turns, clocks, trainers = Turns(names), {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            trainer = build_trainer(trl_grpo_ext.GRPOTrainer, [*base, "--decode_engine", name], Path(tmp) / name)
            clock = StepClock(name, trainer, turns, 1234, lambda: None)
            clock.wrap(trainer)
            trainer.add_callback(clock)
            trainers[name], clocks[name] = trainer, clock
        train_in_turns(trainers, turns, "sampling")
    out = {name: statistics.median(s["generate"] for s in clock.steps[1:]) for name, clock in clocks.items()}
    same = clocks["generate"].completions == clocks["packed"].completions
    print(f"sampling s/step: generate {out['generate']:.2f}, packed {out['packed']:.2f} (same completions: {same})")
    return out


def eval_seconds(model_name: str, limit: int, max_new_tokens: int) -> dict[str, float]:
    """Seconds of the eval's greedy pass over `limit` held-out problems per engine (best of two, alternated), and
    the number of completions that differ between them."""
    from trl_grpo_ext.evaluation import evaluate

    gen, problems = heldout_eval(model_name, limit, max_new_tokens)
    seconds: dict[str, list[float]] = {"generate": [], "packed": []}
    texts = {}
    for engine in ("generate", "packed", "generate", "packed"):
        gen.decode_engine = engine
        start = time.perf_counter()
        results, _ = evaluate(problems, gen, k=1, batch_size=8, progress=False)
        seconds[engine].append(time.perf_counter() - start)
        texts[engine] = [r.greedy_completion for r in results]
    best = {engine: min(v) for engine, v in seconds.items()}
    differ = sum(a != b for a, b in zip(texts["generate"], texts["packed"], strict=True))
    print(
        f"eval over {len(problems)} problems: generate {best['generate']:.1f} s, packed {best['packed']:.1f} s; "
        f"completions that differ: {differ}"
    )
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--sampling-steps", type=int, default=3, help="timed recipe steps per engine (0: skip)")
    parser.add_argument("--eval", type=int, default=64, help="held-out problems of the eval pass (0: skip)")
    parser.add_argument("--eval-tokens", type=int, default=256, help="new tokens per eval completion")
    parser.add_argument("--quick", action="store_true", help="tiny random model: a smoke test (numbers meaningless)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    from trl_grpo_ext.cpu.precision import resolve_precision
    from trl_grpo_ext.models import resolve_model

    overrides: list[str] = []
    if args.quick:
        from conftest import build_tiny_model

        model_path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        overrides = ["--model_name_or_path", model_path, "--max_completion_length", "8"]
        args.new_tokens, args.sampling_steps, args.eval, args.eval_tokens = 4, min(args.sampling_steps, 1), 8, 8
    else:
        model_path = resolve_model("embedded")
    auto = resolve_precision("auto", on_cpu=True)
    precision = "bf16" if auto.bf16 else "fp32"
    print(f"torch threads {torch.get_num_threads()}; bf16: auto is {precision} here ({auto.reason})")
    precisions = [("fp32", False)] + ([("bf16 (auto)", True)] if auto.bf16 else [])
    if not auto.bf16:
        print("the auto precision is fp32 on this CPU: its rows are the fp32 rows")
    ratios = decode_table(model_path, args.new_tokens, precisions)
    sampling = eval_ratio = "n/a (skipped)"
    if args.sampling_steps:
        s = sampling_seconds(overrides, args.sampling_steps)
        sampling = f"{s['packed'] / s['generate']:.2f}"
    if args.eval:
        e = eval_seconds(model_path, args.eval, args.eval_tokens)
        eval_ratio = f"{e['packed'] / e['generate']:.2f}"
    label = precisions[-1][0] if auto.bf16 else "fp32"
    parts = ", ".join(f"{rows} rows {ratios[(label, rows)]:.2f}x" for rows in ROWS)
    print(f"decode: {parts} the bound ({precision}); sampling new/old {sampling}; eval new/old {eval_ratio}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    main()
