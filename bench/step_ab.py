"""Whole GRPO steps of ours, this tree against another revision, alternated: did a change make steps slower?

`bench/step_time.py` compares ours with vanilla TRL in one run; two such runs taken at different hours don't
compare with each other (the host's speed moves by tens of percent). This bench answers the other question: the
same steps of `trl_grpo_ext.GRPOTrainer` with this tree's code and with `--base`'s (a git revision, checked out into
a temporary worktree), on the embedded recipe with step_time's pinned batch and task mix, each in a fresh process,
the two taking turns over `--rounds` rounds. Every step starts from the same torch RNG state in both, so step k
samples the same completions in both (checked: the per-step completion lengths must match). A step is timed from
one ``on_step_begin`` to the next, so work after ``on_step_end`` (the per-cycle context's backward) counts too; the
first step is a warm-up.

Prints per-step ratios this/base, and last ``step A/B this/base: <geometric mean> [<95% bootstrap interval>]
(G=<n>, <pairs> paired steps)``. Run on an idle machine, nothing else running:

    python bench/step_ab.py --base 40403ee            # ~12 min on 2 cores (3 rounds x 4 timed steps, G=4)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(tree: Path, overrides: list[str]) -> None:
    """In a fresh process: ours from `tree`'s code on the recipe with `overrides`; prints one JSON line."""
    sys.path[:0] = [str(tree), str(tree / "bench"), str(tree / "tests")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import step_time
    import torch
    from transformers import TrainerCallback

    import trl_grpo_ext

    marks, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())
            torch.manual_seed(1234 + state.global_step)  # step k samples from the same state in both trees

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

        def on_train_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        trainer = step_time.build_trainer(trl_grpo_ext.GRPOTrainer, overrides, Path(tmp) / "run")
        trainer.add_callback(Clock())
        trainer.train()
    seconds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    print(json.dumps({"package": trl_grpo_ext.__file__, "steps": seconds, "lengths": lengths}))


def overrides_for(generations: int, steps: int) -> list[str]:
    """step_time's pinned batch and task mix (this tree's, whatever the base's bench says), `generations` per
    prompt, `steps` + 1 optimizer steps, per-step logs (for the completion lengths)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from step_time import PINNED_BATCH

    return [
        *PINNED_BATCH, "--num_generations", str(generations), "--gradient_accumulation_steps",
        str(3 * generations // 4), "--max_steps", str(steps + 1), "--logging_steps", "1", "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip


def run_tree(tree: Path, args) -> dict:
    overrides = json.dumps(overrides_for(args.generations, args.steps))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", str(tree), overrides]
    # the thread count fixed at torch's default in both (the base may predate the load governor)
    env = {**os.environ, "TRL_GRPO_EXT_CPU_THREADS": "fixed"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=tree, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["package"].startswith(str(tree)):
        raise RuntimeError(f"{tree}: the worker imported {out['package']}, not this tree's package")
    return out


def summary(ratios: list[float], seed: int = 0, draws: int = 10_000) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios and its 95% bootstrap interval (seeded: the same figures every run)."""
    rng = random.Random(seed)
    means = sorted(statistics.geometric_mean(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.geometric_mean(ratios), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker(Path(argv[1]), json.loads(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare this tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (after a warm-up step)")
    parser.add_argument("--generations", type=int, default=4, choices=(4, 8))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process, at most")
    args = parser.parse_args(argv)
    if min(args.rounds, args.steps) < 1:
        parser.error("--rounds and --steps must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)  # fmt: skip
        try:
            ratios = []
            for round_ in range(args.rounds):
                order = [("base", base), ("this", ROOT)]
                runs = dict((name, run_tree(tree, args)) for name, tree in (order if round_ % 2 else order[::-1]))
                if runs["this"]["lengths"] != runs["base"]["lengths"]:
                    raise RuntimeError(f"round {round_}: the two trees sampled different completions")
                this, other = runs["this"]["steps"][1:], runs["base"]["steps"][1:]
                ratios += [t / b for t, b in zip(this, other, strict=True)]
                print(f"round {round_ + 1}: this {' '.join(f'{s:.1f}' for s in this)} s, base "
                      f"{' '.join(f'{s:.1f}' for s in other)} s", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    mean, low, high = summary(ratios)
    print("per-step this/base:", " ".join(f"{r:.2f}" for r in ratios))
    print(f"step A/B this/base: {mean:.2f} [{low:.2f}, {high:.2f}] (G={args.generations}, {len(ratios)} paired steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
