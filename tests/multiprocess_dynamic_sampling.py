"""Dynamic sampling under `accelerate launch --num_processes 2` (gloo on CPU), recorded for tests/test_dynamic_sampling.py.

Generation is TRL's `rollout_func` hook (deterministic completions per prompt and copy), so the run is cheap and
the degenerate groups are known: prompts with an even id always score the same (a degenerate group). Each rank
writes what it generated (how many generation batches per step) and which prompt ids it trained on.

    python tests/multiprocess_dynamic_sampling.py --model PATH --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from multiprocess_grpo import CPU_RUN  # noqa: E402

NUM_GENERATIONS = 2
NUM_PROMPTS = 16
FIRST_TOKEN = 3  # the tiny tokenizer's special tokens are ids 0-2


def prompt_text(pid: int) -> str:
    return f"Question {pid}: what is {pid} + {pid}?"


def flat_for_even(completions, pid, completion_ids, **kwargs):
    """Even prompt ids: 1.0 whatever the completion (degenerate); odd: the completion's length (varied)."""
    return [1.0 if p % 2 == 0 else float(len(ids)) for ids, p in zip(completion_ids, pid, strict=True)]


def rollout(prompts, trainer):
    tokenizer = trainer.processing_class
    prompt_ids, completions = [], []
    for i, prompt in enumerate(prompts):
        pid = int(prompt.split()[1].rstrip(":"))
        copy = i % NUM_GENERATIONS  # groups never straddle processes with dynamic sampling
        rng = random.Random(pid * 1000 + copy)
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        length = 2 + copy  # lengths differ within a group
        completions.append([rng.randrange(FIRST_TOKEN, len(tokenizer)) for _ in range(length)])
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def run(model_path: str, out_dir: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext import GRPOConfig, GRPOTrainer

    class Recorder(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self.generated.append(self.state.global_step)
            return super()._generate_and_score_completions(inputs)

        def _compute_loss(self, model, inputs):
            texts = self.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
            active = (inputs["completion_mask"].sum(1) > 0).tolist()
            self.trained.append([int(t.split()[1].rstrip(":")) for t, a in zip(texts, active, strict=True) if a])
            return super()._compute_loss(model, inputs)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_dict(
        {"prompt": [prompt_text(p) for p in range(NUM_PROMPTS)], "pid": list(range(NUM_PROMPTS))}
    )
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=4,  # two groups per process, four per generation batch
        max_completion_length=8,
        learning_rate=1e-3,
        dynamic_sampling=True,
        max_generation_batches=6,
        seed=0,
        max_steps=3,
        **CPU_RUN,
    )
    trainer = Recorder(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        reward_funcs=[flat_for_even],
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        rollout_func=rollout,
    )
    trainer.generated, trainer.trained = [], []
    trainer.train()
    rank = trainer.accelerator.process_index
    record = {
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "generated": trainer.generated,
        "trained": trainer.trained,
        "log_history": [row for row in trainer.state.log_history if "loss" in row],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    run(cli.model, cli.out)
