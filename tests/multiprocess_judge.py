"""A judge down for one process only, under `accelerate launch --num_processes 2` (gloo on CPU), for
`tests/test_rewards_judge_runs.py`: process 0's judge points at a closed port, process 1's at a server that answers.
Process 0's judge stops the run after its first step (``max_failed_steps: 1``); every process must stop then, each
saying why, rather than process 0 alone.

    accelerate launch --multi_gpu --num_processes 2 tests/multiprocess_judge.py --model PATH --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(model_path: str, out_dir: str) -> int:
    from datasets import Dataset
    from judge_servers import ScriptedServer, free_port
    from multiprocess_grpo import CPU_RUN, NUM_GENERATIONS, prompt_text, rollout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext import GRPOConfig, GRPOTrainer
    from trl_grpo_ext.task.rewards import JudgeUnavailableError, make_judge_reward

    rank = int(os.environ.get("RANK", "0"))
    with ScriptedServer(lambda index, body: ("ok", "5")) as server:
        url = f"http://127.0.0.1:{free_port()}/v1" if rank == 0 else server.base_url
        judge = make_judge_reward(
            {
                "base_url": url,
                "model": "judge",
                "rubric": "Score 1-10.",
                "score_range": [1, 10],
                "retries": 0,
                "timeout_s": 5,
                "max_failed_steps": 1,
            }  # fmt: skip
        )
        args = GRPOConfig(
            output_dir=out_dir,
            num_generations=NUM_GENERATIONS,
            per_device_train_batch_size=NUM_GENERATIONS,
            max_completion_length=16,
            max_steps=3,
            shuffle_dataset=False,
            **CPU_RUN,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path),
            reward_funcs=[judge],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [prompt_text(p) for p in range(12)]}),
            processing_class=AutoTokenizer.from_pretrained(model_path),
            rollout_func=rollout,
        )
        try:
            trainer.train()
        except JudgeUnavailableError as error:
            print(f"process {rank} stopped: {error}", flush=True)
            return 3
    print(f"process {rank} finished", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    sys.exit(main(cli.model, cli.out))
