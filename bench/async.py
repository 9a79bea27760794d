"""Asynchronous vs on-policy GRPO on the embedded default: the training phase's step time side by side with the ideal
overlap bound from the same run's phase times, and (``--sweep``) what each setting learned.

Timing (run on an idle machine; ~30 min on 2 CPU cores): the embedded recipe (recipes/gsm8k/embedded.yaml, no eval)
for ``--steps`` optimizer steps in each of four settings, each its own process, the four alternated ``--rounds``
times so the machine's drift hits all alike:

- on-policy at every core (``sync``, the step as ``make train`` runs it idle): its sampling time per step S2
  (transformers' generate, timed around ``_generate_single_turn``) and the rest T2 (the loss's forwards, backward,
  optimizer);
- on-policy at one core (S1, T1: each side's time when it has one core, as in an asynchronous run on 2 cores);
- asynchronous (`trl_grpo_ext.trl.async_sampling`: sampler and trainer one core each), ``max_staleness`` 1 (what
  ``make train`` runs: the sampler one step ahead) and ``max_staleness`` 2 drawing two steps ahead
  (``sample_ahead: 2``).

The first step of each process (loading, the first sampler start) is left out; a step's time is wall clock from
its start to its end. The ideal bound of overlap alone is ``max(S1, T1) / (S2 + T2)``: both sides at one core, in
parallel, against the on-policy step at every core. Threads are fixed (``TRL_GRPO_EXT_CPU_THREADS=fixed``).

Learning (``--sweep DIR``, repeatable: the output of ``trl-grpo-ext sweep recipes/sweeps/embedded_async.yaml``, and
of ``embedded_async_temperature.yaml``): per loss and setting (on-policy, or the objective at ``max_staleness`` K) the
mean held-out format-independent gain over seeds with its 95% interval, the training phase's wall time (as each run
measured it), the mean staleness, and each asynchronous setting against on-policy with the same loss and sampling
temperature: the difference of held-out accuracy after training (paired over the eval problems, seeds resampled,
`trl_grpo_ext.experiments.seed_comparison.pair_difference`). Only finished runs count. On-policy the three ratio
losses take one gradient, so a loss without on-policy runs of its own is compared with another loss's (marked so).

Last line: ``async: step async/sync X (K=1), Y (K=2, sample_ahead 2); held-out gain difference D [lo, hi];
decoupled K=4 gain difference D4 [lo, hi]`` with D the loss ``--loss`` (default cispo) under the decoupled objective
at K=2, D4 at K=4, against on-policy. Targets: X <= 0.8; D and D4's intervals include 0 with D4 >= -0.01.
``--quick``: the tiny random model, 3 steps, one round (a smoke test; numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETTINGS = {  # name: (torch threads, recipe flags)
    "sync": (None, ["--async_sampling", "false"]),
    "sync@1": (1, ["--async_sampling", "false"]),
    "async K=1": (None, ["--async_sampling", "true", "--max_staleness", "1"]),
    "async K=2": (None, ["--async_sampling", "true", "--max_staleness", "2", "--sample_ahead", "2"]),
}
CHILD_MARK = "BENCH_ASYNC_RESULT "


# ------------------------------------------------------------------------------------------ one setting, in a child
def child(argv: list[str]) -> None:
    """Run the recipe with `argv`, timing each step and the trainer's own generation; print one JSON line."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "recipes"))
    import gsm8k_grpo

    from trl_grpo_ext.trl import trainer as trainer_module

    sampling, steps = [0.0], []
    generate = trainer_module.GRPOTrainer._generate_single_turn

    def timed_generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(self, *args, **kwargs)
        finally:
            sampling[-1] += time.perf_counter() - t0

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            sampling.append(0.0)

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.perf_counter() - self.started)

    trainer_module.GRPOTrainer._generate_single_turn = timed_generate
    init = trainer_module.GRPOTrainer.__init__

    def with_timer(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(StepTimes())

    trainer_module.GRPOTrainer.__init__ = with_timer
    code = gsm8k_grpo.main(argv)
    print(CHILD_MARK + json.dumps({"code": code, "steps": steps, "sampling": sampling[1:]}), flush=True)


def run_setting(name: str, args, out: Path) -> dict:
    threads, flags = SETTINGS[name]
    env = {**os.environ, "TRL_GRPO_EXT_CPU_THREADS": "fixed", "OMP_NUM_THREADS": str(threads or args.cores)}
    argv = [
        "--config", str(ROOT / "recipes" / "gsm8k" / "embedded.yaml"), "--max_steps", str(args.steps),
        "--eval_num_samples", "0", "--output_dir", str(out), "--report_to", "none", *flags, *args.model_flags,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(argv)], env=env, capture_output=True, text=True, timeout=7200
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith(CHILD_MARK)), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{name}: the recipe failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    result = json.loads(line[len(CHILD_MARK) :])
    if result["code"] != 0:
        raise SystemExit(f"{name}: the recipe exited with {result['code']}")
    return result


def timing(args) -> dict[str, dict]:
    per: dict[str, dict[str, list[float]]] = {name: {"step": [], "sampling": []} for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in SETTINGS:
                t0 = time.perf_counter()
                result = run_setting(name, args, Path(tmp) / f"{name.replace(' ', '_')}-{r}")
                per[name]["step"] += result["steps"][1:]  # the first step warms up
                per[name]["sampling"] += result["sampling"][1:]
                print(
                    f"  round {r + 1} {name}: steps {' '.join(f'{s:.2f}' for s in result['steps'])} s "
                    f"({time.perf_counter() - t0:.0f} s with loading)",
                    flush=True,
                )
    return {
        name: {"step": statistics.mean(v["step"]), "sampling": statistics.mean(v["sampling"]), "n": len(v["step"])}
        for name, v in per.items()
    }


def timing_lines(t: dict[str, dict]) -> tuple[list[str], dict[str, float]]:
    s2, s1 = t["sync"]["sampling"], t["sync@1"]["sampling"]
    t2, t1 = t["sync"]["step"] - s2, t["sync@1"]["step"] - s1
    bound = max(s1, t1) / (s2 + t2)
    ratios = {k: t[f"async K={k}"]["step"] / t["sync"]["step"] for k in (1, 2)}
    lines = [
        "| setting | step (s) | steps timed | sampling (s) | the rest (s) |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {v['step']:.2f} | {v['n']} | "
            + (f"{v['sampling']:.2f} | {v['step'] - v['sampling']:.2f} |" if name.startswith("sync") else "- | - |")
            for name, v in t.items()
        ),
        "",
        f"ideal overlap bound max(S1, T1) / (S2 + T2) = max({s1:.2f}, {t1:.2f}) / ({s2:.2f} + {t2:.2f}) = {bound:.2f}",
        f"async/sync step, K=1: {ratios[1]:.2f} (bound {bound:.2f})",
        f"async/sync step, K=2 (sample_ahead 2): {ratios[2]:.2f} (bound {bound:.2f})",
    ]
    return lines, ratios


# ------------------------------------------------------------------------------------------ the sweep's learning
def learning(sweep_dirs: list[Path], loss: str) -> tuple[list[str], dict[str, str]]:
    from trl_grpo_ext.experiments.compare import load_runs, summarize
    from trl_grpo_ext.experiments.seed_comparison import group_by_seed, group_interval, pair_difference
    from trl_grpo_ext.report.text import interval_text
    from trl_grpo_ext.runs import RUN_SUMMARY_FILENAME

    # A run counts once it has finished: its held-out evaluation after training is in (a sweep in progress, or
    # one stopped part way, leaves folders with only their config).
    runs = [r for r in load_runs(sweep_dirs) if r.heldout_problems.get("after")]
    summaries = [summarize(r) for r in runs]
    groups = group_by_seed(runs, summaries, {"output_dir", "run_name", "logging_dir"})

    def setting(group) -> tuple[str, str, float]:
        """(loss, mode, temperature): mode ``sync`` or ``<objective> K=<max_staleness>``."""
        config = group.runs[0].config
        k = config.get("max_staleness", 1) if config.get("async_sampling") in (True, "true", "True") else 0
        temperature = float(config.get("temperature", 1.0))
        mode = "sync" if not k else f"{config.get('async_objective', 'decoupled')} K={k}"
        return str(config.get("loss_type")), mode, temperature

    def run_summary(group, key: str) -> float | None:
        values = []
        for run in group.runs:
            path = run.path / RUN_SUMMARY_FILENAME
            if path.is_file():
                values.append(json.loads(path.read_text()).get(key))
        values = [v for v in values if isinstance(v, (int, float))]
        return statistics.mean(values) if values else None

    def mean_of(group, key: str) -> float:
        values = [float(row[key]) for run in group.runs for row in run.rows if isinstance(row.get(key), (int, float))]
        return statistics.mean(values) if values else 0.0

    def correction(group) -> str:
        """What the correction met over the group's steps: the sampler-trainer KL a step, the largest behaviour
        ratio, the share of tokens the loss's clip bound (PPO's low and high, CISPO's bounds) and the share the
        behaviour weight truncated or masked."""
        largest = max(
            (float(r["sampling/is_ratio_raw/max"]) for run in group.runs for r in run.rows
             if "sampling/is_ratio_raw/max" in r),
            default=1.0,
        )  # fmt: skip
        clipped = mean_of(group, "clip_low_frac") + mean_of(group, "clip_high_frac")
        masked = mean_of(group, "sampling/is_ratio_truncated_frac")
        return (
            f"{mean_of(group, 'sampling/sampler_kl'):.4f} / {largest:.2f} / {100 * clipped:.2f}% / {100 * masked:.2f}%"
        )

    by = {setting(g): g for g in groups}
    # On-policy, cispo, importance_sampling and ppo take one gradient (every ratio is 1, inside every clip:
    # tests/test_losses.py), so a loss without on-policy runs of its own is compared with another loss's.
    on_policy = {(name, t): g for (name, mode, t), g in by.items() if mode == "sync"}
    lines = [
        "| loss | temperature | setting | seeds | held-out gain (format-independent) | after − on-policy after | "
        "mean staleness | training phase (s) | sampler KL / largest ratio / clipped / masked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    headlines = {}
    order = sorted(by.items(), key=lambda item: (item[0][2], item[0][0], item[0][1] != "sync", item[0][1]))
    for (name, mode, t), group in order:
        gain = group_interval(group, "heldout_gain_any_format")
        diff = "-"
        same_t = [g for (n, tt), g in on_policy.items() if tt == t]
        reference = on_policy.get((name, t), on_policy.get((loss, t), same_t[0] if same_t else None))
        if mode != "sync" and reference is not None:
            iv, _how = pair_difference(group, reference, "heldout_after_any_format")
            if iv is not None:
                diff = interval_text(iv.estimate, iv.low, iv.high, 3)
                if reference is not on_policy.get((name, t)):
                    diff += f" (vs {setting(reference)[0]}'s on-policy runs)"
                if name == loss and t == 1.0 and mode.startswith("decoupled"):
                    headlines[mode] = interval_text(iv.estimate, iv.low, iv.high, 3)
        gain_text = "-" if gain is None else interval_text(gain.estimate, gain.low, gain.high, 3, missing=" (1 seed)")
        seconds = run_summary(group, "training_phase_s")
        staleness = "-" if mode == "sync" else f"{mean_of(group, 'sample/staleness_mean'):.2f}"
        lines.append(
            f"| {name} | {t:g} | {mode} | {len(group.runs)} | {gain_text} | {diff} | {staleness} | "
            f"{'-' if seconds is None else f'{seconds:.0f}'} | {correction(group)} |"
        )
    return lines, headlines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per process (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=2, help="times the four settings are run, alternated")
    parser.add_argument(
        "--sweep", type=Path, action="append", help="a finished embedded_async(_temperature) sweep's output folder"
    )
    parser.add_argument("--loss", default="cispo", help="the loss of the last line's held-out difference")
    parser.add_argument("--no-timing", action="store_true", help="only the sweep's table (with --sweep)")
    parser.add_argument("--quick", action="store_true", help="the tiny random model, 3 steps, one round")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    args.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    args.model_flags = []
    if args.quick:
        from conftest import build_tiny_model

        tiny = Path(tempfile.mkdtemp()) / "tiny"
        build_tiny_model(tiny)
        args.model_flags = ["--model_name_or_path", str(tiny), "--max_completion_length", "8"]
        args.steps, args.rounds = 3, 1
    ratios = None
    if not args.no_timing:
        print(f"timing: {len(SETTINGS)} settings x {args.rounds} rounds, {args.steps} steps each, {args.cores} cores")
        lines, ratios = timing_lines(timing(args))
        print("\n".join(lines))
    headlines = {}
    if args.sweep:
        lines, headlines = learning(args.sweep, args.loss)
        print("\n".join(lines))
    step = (
        "n/a (K=1), n/a (K=2, sample_ahead 2)"
        if ratios is None
        else f"{ratios[1]:.2f} (K=1), {ratios[2]:.2f} (K=2, sample_ahead 2)"
    )

    def difference(k: int) -> str:
        if not args.sweep:
            return "n/a (run with --sweep)"
        return headlines.get(
            f"decoupled K={k}", f"n/a (no finished decoupled {args.loss} runs at K={k} and on-policy)"
        )

    print(
        f"async: step async/sync {step}; held-out gain difference {difference(2)}; "
        f"decoupled K=4 gain difference {difference(4)}"
    )


if __name__ == "__main__":
    main()
