"""GRPO step time: vanilla `trl.GRPOTrainer` vs ours (`trl_grpo_ext.GRPOTrainer`, prompt-prefix sharing), alternated.

Both trainers get the same recipe config (the embedded default, then the same with ``num_generations: 8``), the
same seed and the same batches: they run in two threads that take turns step by step (vanilla step k, then ours
step k), and each step starts from the same torch RNG state, so both sample from the same state (whether the
completions came out identical is printed). Neighbours' load on a shared machine hits both alike.

Per phase, wall seconds per optimizer step (median over the timed steps; the first step of each is a warm-up):

- ``generate``: ``_generate_single_turn`` (transformers ``generate``, or ours with the shared prefill);
- ``log-prob forward``: every ``_get_per_token_logps_and_entropies`` call (old/reference log-probs and the
  training forward);
- ``backward``: ``accelerator.backward``;
- ``rewards``: ``_calculate_rewards``;
- ``other``: the rest of the step (optimizer, advantages, bookkeeping).

FLOPs: the warm-up step of each trainer runs under ``torch.utils.flop_counter.FlopCounterMode`` (matmuls,
attention; untimed); the compute bound is those FLOPs at the fastest matmul rate the machine offers, measured in
this run (best of repeated ``(2048 x 576) @ (576 x 1536)`` products, the embedded model's MLP shape, before and
between steps): fp32 and bf16 are both measured and printed, and the faster one is the bound (bf16 where the CPU
has bf16 matrix units; without them torch emulates bf16, slower than fp32).

Precision: each configuration runs in fp32 (``--bf16 false``) and in the recipe's ``bf16: auto`` choice
(`trl_grpo_ext.cpu.precision`) when that is bf16; vanilla TRL gets the same resolved ``bf16``, so for the bf16 rows
its peer is vanilla TRL with ``bf16: true``. Where auto is fp32 the auto rows are the fp32 rows (said so, not run
twice).

Last line: ``step time ours/vanilla: <x> (G=4), <y> (G=8); ours at <z>x the compute bound`` (z for G=4), for the
auto choice. Targets: x <= 0.55, y <= 0.40, z <= 1.5.

``--eval N`` also times the eval's greedy pass (``trl-grpo-ext eval``'s generator, batches of 8, 64 new tokens)
over N held-out problems with plain ``generate`` (no sharing) and with the shared prefix, alternated.

Run on an idle machine: ``python bench/step_time.py --eval 400`` (embedded model, 4 timed steps per trainer and
config; tens of minutes on 2 CPU cores); ``--quick`` runs the tiny random test model for a smoke test (about a
minute, numbers meaningless).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

# The batch and task mix of the embedded default these figures were measured and documented with
# (docs/prefix_sharing.md: 3 prompts x 4, a quarter long gsm_symbolic prompts), pinned whatever it becomes.
PINNED_BATCH = [
    "--synthetic_tasks",
    "chain_sum_easy:3,chain_sum:2,basic_arithmetic:2,gsm_symbolic:1",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "3",
]
PHASES = ("generate", "log-prob forward", "backward", "rewards")
WRAPPED = {
    "_generate_single_turn": "generate",
    "_get_per_token_logps_and_entropies": "log-prob forward",
    "_calculate_rewards": "rewards",
}


def matmul_rate(seconds: float = 1.0, dtype: torch.dtype = torch.float32, rows: int = 2048) -> float:
    """FLOP/s of a (rows x 576) @ (576 x 1536) product in `dtype`, best of repeated timings."""
    a, b = torch.randn(rows, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    flops = 2 * rows * 576 * 1536
    best = float("inf")
    deadline = time.perf_counter() + seconds
    for _ in range(3):
        torch.mm(a, b)
    while best == float("inf") or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / 4)
    return flops / best


class Turns:
    """Two threads take turns, one optimizer step each, in the order of `names`."""

    def __init__(self, names):
        self.names = list(names)
        self.turn = 0
        self.cond = threading.Condition()
        self.done = set()

    def wait(self, name):
        with self.cond:
            self.cond.wait_for(lambda: self.names[self.turn % len(self.names)] == name)

    def pass_on(self, name, finished=False):
        with self.cond:
            if finished:
                self.done.add(name)
            self.turn += 1
            while self.names[self.turn % len(self.names)] in self.done and len(self.done) < len(self.names):
                self.turn += 1
            self.cond.notify_all()


class StepClock(TrainerCallback):
    """Times each optimizer step and its phases; counts the first step's FLOPs; takes turns with the other."""

    def __init__(self, name, trainer_ref, turns, seed, between_steps):
        self.name, self.trainer_ref, self.turns, self.seed = name, trainer_ref, turns, seed
        self.between_steps = between_steps
        self.phase_time = defaultdict(float)
        self.steps = []  # per step: {"total": s, phase: s, ...}
        self.flops = None
        self.completions = []
        self._flop_mode = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.turns.wait(self.name)
        self.between_steps()
        torch.manual_seed(self.seed + state.global_step)  # both trainers sample from the same RNG state
        self.phase_time.clear()
        if state.global_step == 0:
            from torch.utils.flop_counter import FlopCounterMode

            self._flop_mode = FlopCounterMode(display=False)
            self._flop_mode.__enter__()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        total = time.perf_counter() - self._start
        if self._flop_mode is not None:
            self._flop_mode.__exit__(None, None, None)
            self.flops = self._flop_mode.get_total_flops()
            self._flop_mode = None
        self.steps.append({"total": total, **self.phase_time})
        self.turns.pass_on(self.name, finished=state.global_step >= state.max_steps)

    def wrap(self, trainer):
        for method, phase in WRAPPED.items():
            original = getattr(trainer, method)

            def timed(*args, _original=original, _phase=phase, _method=method, **kwargs):
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                self.phase_time[_phase] += time.perf_counter() - start
                if _method == "_generate_single_turn":
                    self.completions.append(out[0])
                return out

            setattr(trainer, method, timed)
        backward = trainer.accelerator.backward

        def timed_backward(*args, **kwargs):
            start = time.perf_counter()
            out = backward(*args, **kwargs)
            self.phase_time["backward"] += time.perf_counter() - start
            return out

        trainer.accelerator.backward = timed_backward


def recipe_args(overrides: list[str]):
    from trl_grpo_ext.trl.script_args import parse_recipe_args

    return parse_recipe_args(["--config", str(ROOT / "recipes/gsm8k/embedded.yaml"), *overrides])


def build_trainer(cls, overrides, out_dir):
    import trl_grpo_ext.trl.recipe as recipe

    script_args, training_args, model_args = recipe_args([*overrides, "--output_dir", str(out_dir)])
    script_args.eval_num_samples = 0
    run = recipe.prepare_run(script_args, training_args, model_args)
    model = recipe.load_model(run.model_path, model_args, training_args)
    trainer = cls(
        model=model,
        reward_funcs=run.reward_funcs,
        args=training_args,
        train_dataset=run.train_dataset,
        processing_class=run.tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def run_config(label, overrides, steps, rates):
    import trl

    import trl_grpo_ext

    overrides = [*overrides, "--max_steps", str(steps + 1), "--logging_steps", "1000", "--report_to", "none"]
    turns = Turns(["vanilla", "ours"])
    clocks = {}
    trainers = {}
    seed = 1234

    def between_steps():
        measure_rates(rates, 0.3)

    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in (("vanilla", trl.GRPOTrainer), ("ours", trl_grpo_ext.GRPOTrainer)):
            trainer = build_trainer(cls, overrides, Path(tmp) / name)
            clock = StepClock(name, trainer, turns, seed, between_steps)
            clock.wrap(trainer)
            trainer.add_callback(clock)
            trainers[name], clocks[name] = trainer, clock
        train_in_turns(trainers, turns, label)
        stats = getattr(trainers["ours"], "prefix_sharing_stats", {})

    result = {"label": label, "flops": {}, "phases": {}, "stats": dict(stats)}
    for name, clock in clocks.items():
        timed = clock.steps[1:]  # the first step is the warm-up (and ran under the FLOP counter)
        result["phases"][name] = {
            key: statistics.median(step.get(key, 0.0) for step in timed) for key in ("total", *PHASES)
        }
        result["flops"][name] = clock.flops
    result["same_completions"] = clocks["vanilla"].completions == clocks["ours"].completions
    return result


def train_in_turns(trainers: dict, turns: Turns, label: str) -> None:
    """Train each of `trainers` (name -> trainer, their `StepClock`s sharing `turns`) in a thread of its own, the
    threads taking turns step by step; a failure is raised once both have stopped."""
    errors = []

    def train(name):
        try:
            trainers[name].train()
        except BaseException as exc:  # report after both threads stop
            errors.append((name, exc))
            turns.pass_on(name, finished=True)

    threads = [threading.Thread(target=train, args=(name,)) for name in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{label}: {errors[0][0]} failed") from errors[0][1]


def measure_rates(rates: dict, seconds: float) -> None:
    """Append one fp32 and one bf16 matmul rate to `rates` ({"fp32": [...], "bf16": [...]})."""
    from trl_grpo_ext.cpu.precision import cpu_bf16_units

    rates["fp32"].append(matmul_rate(seconds))
    if cpu_bf16_units()[0]:
        rates["bf16"].append(matmul_rate(seconds, torch.bfloat16))
    elif not rates["bf16"]:  # emulated bf16 (AVX2: 30-60x slower than fp32): one small product says so
        rates["bf16"].append(matmul_rate(0.0, torch.bfloat16, rows=32))


def fastest_rate(rates: dict) -> tuple[float, str]:
    """(the fastest matmul rate measured, its dtype): the compute bound's rate."""
    return max((max(values), name) for name, values in rates.items() if values)


def precision_runs(base: list[str]) -> tuple[list[tuple[str, list[str]]], str]:
    """The precisions to time (fp32, and auto where it is bf16) and the auto choice's startup line."""
    from trl_grpo_ext.trl.recipe import precision_line

    _, auto_args, _ = recipe_args(base)
    runs = [("fp32", ["--bf16", "false"])]
    if auto_args.bf16:
        runs.append(("bf16 (auto)", ["--bf16", "auto"]))
    return runs, precision_line(auto_args)


def group_configs(base: list[str], g4: str, g8: str) -> list[tuple[str, list[str]]]:
    """The two timed configurations: the recipe (G=4) and G=8 with the same prompts per step."""
    return [(g4, base), (g8, [*base, "--num_generations", "8", "--gradient_accumulation_steps", "6"])]


def run_precisions(precisions, configs, steps: int, rates: dict) -> dict:
    """`run_config` for every (precision, configuration), keyed so; the matmul rates measured once more after."""
    results = {
        (name, label): run_config(f"{label}, {name}", [*overrides, *flags], steps, rates)
        for name, flags in precisions
        for label, overrides in configs
    }
    measure_rates(rates, 1.0)
    return results


def report(result, rate):
    label, phases = result["label"], result["phases"]
    print(f"\n== {label} ==")
    print(f"{'phase':<18}{'vanilla s':>11}{'ours s':>10}{'ours/vanilla':>14}")
    for key in (*PHASES, "other", "total"):
        if key == "other":
            v = phases["vanilla"]["total"] - sum(phases["vanilla"][p] for p in PHASES)
            o = phases["ours"]["total"] - sum(phases["ours"][p] for p in PHASES)
        else:
            v, o = phases["vanilla"][key], phases["ours"][key]
        ratio = f"{o / v:.3f}" if v > 0 else "-"
        print(f"{key:<18}{v:>11.3f}{o:>10.3f}{ratio:>14}")
    for name in ("vanilla", "ours"):
        flops = result["flops"][name]
        bound = flops / rate
        print(
            f"{name}: {flops / 1e9:.1f} GFLOP per step (warm-up step), compute bound {bound:.2f} s at "
            f"{rate / 1e9:.1f} GFLOP/s; step at {phases[name]['total'] / bound:.2f}x the bound"
        )
    stats = result["stats"]
    if stats.get("prompt_tokens"):
        print(
            f"ours: log-prob forwards encoded {stats['prompt_tokens_encoded']} of {stats['prompt_tokens']} prompt "
            f"tokens ({stats.get('shared_chunks', 0)} shared chunks, {stats.get('plain_chunks', 0)} plain; prompt "
            f"contexts: {stats.get('cycle_contexts', 0)} per accumulation cycle, {stats.get('call_contexts', 0)} per "
            f"no-grad call, {stats.get('context_tokens', 0)} tokens)"
        )
    print(f"identical completions every step: {result['same_completions']}")
    ratio = phases["ours"]["total"] / phases["vanilla"]["total"]
    return ratio, phases["ours"]["total"] / (result["flops"]["ours"] / rate)


def plain_generate(
    model, prompts, pad_token_id, generation_config=None, pad_to_multiple_of=None, engine="generate", **kwargs
):
    """`shared_prefix_generate`'s contract without sharing: the left-padded prompts decoded by `engine`
    (`trl_grpo_ext.decode`)."""
    from trl_grpo_ext.decode import decode
    from trl_grpo_ext.prefix.generation import _left_pad

    ids, mask = _left_pad(prompts, pad_token_id, pad_to_multiple_of, next(model.parameters()).device)
    kwargs.setdefault("pad_token_id", pad_token_id)
    return decode(model, engine, ids, mask, generation_config=generation_config, **kwargs)


def heldout_eval(model_name: str, limit: int, max_new_tokens: int):
    """`trl-grpo-ext eval`'s generator for `model_name` and the first `limit` held-out problems of the embedded
    eval set, prompted as the eval prompts them."""
    from trl_grpo_ext.evaluation import EMBEDDED_DATA, HELDOUT_SEED, HFGenerator, load_rows, problems_from_rows

    gen = HFGenerator(model_name, max_new_tokens=max_new_tokens, seed=0)
    problems = problems_from_rows(load_rows(EMBEDDED_DATA, limit, HELDOUT_SEED, None), one_shot=True, chat=gen.chat)
    return gen, problems


def eval_time(model_name: str, limit: int, max_new_tokens: int = 64):
    """Seconds of the eval's greedy pass over `limit` held-out problems (``trl-grpo-ext eval`` without the
    cache), with the generator's plain ``generate`` (no sharing) and with prefix sharing, alternated."""
    import trl_grpo_ext.prefix as prefix
    from trl_grpo_ext.evaluation import evaluate

    gen, problems = heldout_eval(model_name, limit, max_new_tokens)
    shared = prefix.shared_prefix_generate
    seconds, texts = defaultdict(list), {}
    try:
        for name in ("before", "after", "before", "after"):
            prefix.shared_prefix_generate = shared if name == "after" else plain_generate
            start = time.perf_counter()
            results, _ = evaluate(problems, gen, k=1, batch_size=8, progress=False)
            seconds[name].append(time.perf_counter() - start)
            texts[name] = [r.greedy_completion for r in results]
    finally:
        prefix.shared_prefix_generate = shared
    return {name: min(v) for name, v in seconds.items()}, texts["before"] == texts["after"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trainer and config (plus a warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 8 new tokens: a smoke test")
    parser.add_argument(
        "--eval", type=int, default=0, metavar="N", help="also time the eval's greedy pass over N problems x 64 tokens"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    base = list(PINNED_BATCH)
    if args.quick:
        from conftest import build_tiny_model

        tiny = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        base += ["--model_name_or_path", tiny, "--max_completion_length", "8"]
    print(f"torch threads: {torch.get_num_threads()}")
    rates = {"fp32": [], "bf16": []}
    measure_rates(rates, 1.0)
    precisions, auto_line = precision_runs(base)
    print(f"recipe's {auto_line}")
    if len(precisions) == 1:
        print("bf16: auto is fp32 on this machine: the auto rows are the fp32 rows")
    configs = group_configs(base, "embedded default (G=4)", "num_generations: 8")
    results = run_precisions(precisions, configs, args.steps, rates)
    rate, fastest = fastest_rate(rates)
    for name, values in rates.items():
        print(
            f"{name} matmul rate: {max(values) / 1e9:.1f} GFLOP/s (best of {len(values)} measurements, median "
            f"{statistics.median(values) / 1e9:.1f})"
        )
    print(f"compute bound at the fastest rate: {fastest}, {rate / 1e9:.1f} GFLOP/s")
    ratios = {key: report(result, rate) for key, result in results.items()}
    print(f"\n{'precision':<14}{'config':<26}{'ours/vanilla':>14}{'ours / bound':>14}")
    for (name, label), (ratio, bound) in ratios.items():
        print(f"{name:<14}{label:<26}{ratio:>14.2f}{bound:>14.2f}")
    auto = precisions[-1][0]
    (x, z), (y, _) = (ratios[(auto, label)] for label, _ in configs)
    if args.eval:
        model_name = base[1] if args.quick else "embedded"
        seconds, same = eval_time(model_name, args.eval)
        print(
            f"\neval, greedy, {args.eval} problems x 64 new tokens: {seconds['before']:.1f} s plain generate, "
            f"{seconds['after']:.1f} s shared prefix ({seconds['after'] / seconds['before']:.2f}x); "
            f"identical completions: {same}"
        )
    print(f"\nstep time ours/vanilla: {x:.2f} (G=4), {y:.2f} (G=8); ours at {z:.2f}x the compute bound")


if __name__ == "__main__":
    main()
