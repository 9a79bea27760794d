"""GRPO steps of each new loss type on a tiny model, recorded for `tests/test_multiprocess.py`.

Run once in one process and once under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): both see
the same global batch, so TRL's cross-process token normalisation must give the same loss and gradients, and the
degenerate-group rule the same advantages. Generation is replaced by a deterministic `rollout_func` (TRL's own
hook), so everything after it -- rewards gathered across processes, group advantages, degenerate zeroing, old
log-probabilities, the loss and its normaliser, DDP's gradient all-reduce -- runs as in training.

    python tests/multiprocess_grpo.py --model PATH --out DIR [--only iterations-ppo]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOSS_TYPES = ("importance_sampling", "cispo", "ppo")
NUM_GENERATIONS = 4
COMPLETIONS_PER_GENERATION = 12  # 3 prompt groups of 4: with 2 processes, the middle group straddles them
# "iterations": one micro-batch per step, each generation trained on twice (ratios != 1 on the second step).
# "accumulation": two micro-batches per optimizer step (TRL splits the generation batch), normaliser per window.
SCHEDULES = {
    "iterations": dict(num_iterations=2, gradient_accumulation_steps=1, steps_per_generation=1, max_steps=4),
    "accumulation": dict(num_iterations=1, gradient_accumulation_steps=2, steps_per_generation=2, max_steps=2),
}
# The trainer options every multi-process script shares: CPU (gloo), fp32, a log row per step, nothing saved or shown.
CPU_RUN = dict(use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
FIRST_TOKEN = 3  # the tiny tokenizer's special tokens are ids 0-2


def prompt_text(pid: int) -> str:
    return f"Question {pid}: what is {pid} + {pid}?"


def completion_ids(pid: int, copy: int, eos: int, vocab_size: int) -> list[int]:
    """The `copy`-th completion of prompt `pid`: lengths differ within a group and between processes."""
    import random

    rng = random.Random(pid * 1000 + copy)
    length = 2 + 2 * copy + pid % 3
    ids = [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(length)]
    return ids + [eos] if copy % 2 == 0 else ids  # terminated and truncated completions


def length_reward(completions, pid, completion_ids, **kwargs):
    """pid % 3 == 0: a flat group; 1: varied (with 2 processes, the group that straddles them); 2: flat within
    float noise, degenerate only by `degenerate_tol` (TRL's exact test misses it)."""
    out = []
    for ids, p in zip(completion_ids, pid, strict=True):
        if p % 3 == 0:
            out.append(1.0)
        elif p % 3 == 1:
            out.append(len(ids) / 10)
        else:
            out.append(1.0 + 1e-8 * len(ids))
    return out


def rollout(prompts, trainer):
    """TRL `rollout_func`: this process's prompts are rows [rank * n, (rank + 1) * n) of the generation batch."""
    tokenizer = trainer.processing_class
    start = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completions = [], []
    for i, prompt in enumerate(prompts):
        pid = int(prompt.split()[1].rstrip(":"))
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completions.append(completion_ids(pid, (start + i) % NUM_GENERATIONS, tokenizer.eos_token_id, len(tokenizer)))
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def run(model_path: str, out_dir: str, only: str | None = None) -> None:
    """Every schedule-loss_type pair (``only``: that one), each recorded in ``out_dir/<schedule>-<loss_type>.pt`` by
    the main process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_grpo_ext import GRPOConfig, GRPOTrainer

    class Recorder(GRPOTrainer):
        """Keeps the advantages of every generation batch, gathered over processes (rank order = batch order)."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.recorded_advantages.append(self.accelerator.gather(output["advantages"].detach()).cpu())
            return output

    class Grads(TrainerCallback):
        """The (all-reduced) gradient of every optimizer step."""

        def __init__(self):
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append(torch.cat([p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_dict({"prompt": [prompt_text(p) for p in range(12)], "pid": list(range(12))})
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher; accelerate's state is the trainer's
    for schedule, steps in SCHEDULES.items():
        per_device = COMPLETIONS_PER_GENERATION // (world * steps["steps_per_generation"])
        for loss_type in LOSS_TYPES:
            if only is not None and only != f"{schedule}-{loss_type}":
                continue
            args = GRPOConfig(
                output_dir=str(out / "trainer" / f"{schedule}-{loss_type}"),
                loss_type=loss_type,
                cispo_clip_low=0.9,  # bounds that bite on the second iteration
                cispo_clip_high=1.1,
                beta=0.0,
                num_generations=NUM_GENERATIONS,
                per_device_train_batch_size=per_device,
                max_completion_length=16,
                learning_rate=0.5,
                optim="sgd",  # Adam would turn float-rounding gradients (~1e-9) into full-size updates
                lr_scheduler_type="constant",
                max_grad_norm=1e9,  # logged, never clipped
                shuffle_dataset=False,
                seed=0,
                **CPU_RUN,
                **steps,
            )
            grads = Grads()
            trainer = Recorder(
                model=AutoModelForCausalLM.from_pretrained(model_path),
                reward_funcs=[length_reward],
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                callbacks=[grads],
                rollout_func=rollout,
            )
            trainer.recorded_advantages = []
            trainer.train()
            if trainer.accelerator.is_main_process:
                record = {
                    "world_size": world,
                    "num_processes": trainer.accelerator.num_processes,  # the processes that formed the job
                    "log_history": [row for row in trainer.state.log_history if "loss" in row],
                    "advantages": trainer.recorded_advantages,
                    "grads": [g.cpu() for g in grads.grads],
                }
                torch.save(record, out / f"{schedule}-{loss_type}.pt")
            trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", help="one schedule-loss_type pair, e.g. iterations-ppo")
    cli = parser.parse_args()
    run(cli.model, cli.out, cli.only)
