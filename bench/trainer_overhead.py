"""Step-time overhead of `trl_grpo_ext.GRPOTrainer` against TRL's own trainer, measured side by side.

Four variants on the same tiny random chat model (tests/conftest.py), same data, same seed:

- ``trl/dapo``: vanilla `trl.GRPOTrainer`, loss ``dapo``;
- ``ours/dapo``: the subclass with the same built-in loss (delegated to TRL, plus our metrics and degenerate groups);
- ``ours/importance_sampling`` and ``ours/cispo``: the new loss types.

Two measurements, variants alternating inside every repetition so CPU noise from neighbours hits all alike:

1. full optimizer steps: ``trainer.train()`` for ``--steps`` steps per run, TRL's ``step_time`` metric, first step
   dropped (warm-up), median over all repetitions; learning rate 0, so all variants do identical work;
2. loss only: ``_compute_loss`` + ``backward`` on one fixed generation batch, median over ``--loss-reps``.

Both are reported as wall time and as CPU time of the process (``time.process_time``, the figure the targets are
checked on): on a shared machine the wall time mostly measures the neighbours.

Targets: ours/dapo <= 1.02x trl/dapo; importance_sampling and cispo <= 1.05x ours/dapo.
Ratios are paired: computed per repetition (the variants' runs are adjacent in time), then the median over
repetitions is compared with the target; quartiles show the spread.
Run: ``OMP_NUM_THREADS=1 python bench/trainer_overhead.py [--reps 20 --steps 4]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import trl  # noqa: E402
from conftest import build_tiny_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

from trl_grpo_ext.trl.config import GRPOConfig  # noqa: E402
from trl_grpo_ext.trl.trainer import GRPOTrainer  # noqa: E402

VARIANTS = {
    "trl/dapo": (trl.GRPOTrainer, trl.GRPOConfig, "dapo"),
    "ours/dapo": (GRPOTrainer, GRPOConfig, "dapo"),
    "ours/importance_sampling": (GRPOTrainer, GRPOConfig, "importance_sampling"),
    "ours/cispo": (GRPOTrainer, GRPOConfig, "cispo"),
}
COMPARISONS = [
    ("ours/dapo", "trl/dapo", 1.02),
    ("ours/importance_sampling", "ours/dapo", 1.05),
    ("ours/cispo", "ours/dapo", 1.05),
]


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def build(name, model_path, out_dir, args):
    trainer_cls, config_cls, loss_type = VARIANTS[name]
    config = config_cls(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        loss_type=loss_type,
        per_device_train_batch_size=args.batch,
        num_generations=args.group,
        max_completion_length=args.completion_length,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        # lr 0: every variant generates the same completions step after step, so step times compare equal work
        # (with lr > 0 the losses move the model apart and completion lengths, hence costs, drift).
        learning_rate=0.0,
        seed=0,
    )
    prompts = [[{"role": "user", "content": f"What is {i} + 4? Put the answer in \\boxed{{}}."}] for i in range(64)]
    return trainer_cls(model_path, [length_reward], args=config, train_dataset=Dataset.from_dict({"prompt": prompts}))


class StepClock(TrainerCallback):
    """Wall and CPU (process) time of every optimizer step; CPU time is what neighbours on a shared machine disturb least."""

    def __init__(self):
        self.wall, self.cpu = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


def step_times(name, model_path, out_dir, args):
    torch.manual_seed(0)
    trainer = build(name, model_path, out_dir, args)
    trainer.remove_callback(PrinterCallback)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    return clock.wall[1:], clock.cpu[1:]


def loss_times(model_path, out_dir, args):
    trainers = {name: build(name, model_path, out_dir, args) for name in VARIANTS}
    first = trainers["trl/dapo"]
    first.model.train()
    torch.manual_seed(0)
    inputs = first._generate_and_score_completions(
        [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}]}] * args.batch
    )
    inputs["advantages"] = torch.linspace(-1, 1, inputs["advantages"].numel())
    wall = {name: [] for name in trainers}
    cpu = {name: [] for name in trainers}
    for trainer in trainers.values():
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    for rep in range(-len(trainers), args.loss_reps):  # the first round warms up and is discarded
        names = list(trainers)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            trainer = trainers[name]
            start = time.perf_counter(), time.process_time()
            trainer._compute_loss(trainer.model, dict(inputs)).backward()
            if rep >= 0:
                wall[name].append(time.perf_counter() - start[0])
                cpu[name].append(time.process_time() - start[1])
            trainer.model.zero_grad(set_to_none=True)
            for metrics in trainer._metrics.values():
                metrics.clear()
    return (
        {n: [[v] for v in values] for n, values in wall.items()},
        {n: [[v] for v in values] for n, values in cpu.items()},
    )


def report(title, per_rep):
    """per_rep[name][rep] = times of one run. Ratios are paired: per repetition (runs adjacent in time), then median."""
    print(f"\n{title}")
    for name, reps in per_rep.items():
        pooled = [t for rep in reps for t in rep]
        print(f"  {name:26s} median {statistics.median(pooled) * 1000:8.2f} ms over {len(pooled)}")
    ok = True
    for ours, base, target in COMPARISONS:
        ratios = sorted(
            statistics.median(a) / statistics.median(b) for a, b in zip(per_rep[ours], per_rep[base], strict=True)
        )
        ratio = statistics.median(ratios)
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        ok &= ratio <= target
        verdict = "ok" if ratio <= target else "OVER"
        print(f"  {ours} / {base}: {ratio:.3f}x  (quartiles {q1:.3f}-{q3:.3f}; target <= {target:.2f}x) {verdict}")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="train() runs per variant (alternating)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per train() run (first not timed)")
    parser.add_argument("--loss-reps", type=int, default=200, help="loss+backward repetitions per variant")
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--group", type=int, default=4, help="num_generations")
    parser.add_argument("--completion-length", type=int, default=32, help="max_completion_length")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"torch threads: {torch.get_num_threads()}  reps={args.reps} steps={args.steps} batch={args.batch}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_tiny_model(Path(tmp) / "tiny")
        out_dir = str(Path(tmp) / "out")
        wall = {name: [] for name in VARIANTS}
        cpu = {name: [] for name in VARIANTS}
        for name in VARIANTS:  # warm-up round, discarded: the first runs in a process are slower
            step_times(name, model_path, out_dir, args)
        for rep in range(args.reps):
            names = list(VARIANTS)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                step_wall, step_cpu = step_times(name, model_path, out_dir, args)
                wall[name].append(step_wall)
                cpu[name].append(step_cpu)
        runs = f"{args.reps} runs of {args.steps - 1} timed steps per variant"
        report(f"full optimizer step, wall time ({runs})", wall)
        ok_steps = report(f"full optimizer step, CPU time ({runs})", cpu)
        loss_wall, loss_cpu = loss_times(model_path, out_dir, args)
        report(f"loss + backward only, wall time ({args.loss_reps} alternating rounds)", loss_wall)
        ok_loss = report(f"loss + backward only, CPU time ({args.loss_reps} alternating rounds)", loss_cpu)
    print("\nall targets met" if ok_steps and ok_loss else "\nsome targets missed (see OVER)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
