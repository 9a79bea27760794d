"""The rubric judge's cost against a local `transformers serve` (CPU): throughput, a GRPO step's wait, the cache.

    python bench/judge.py                 # the embedded SmolLM2-135M-Instruct as judge and policy (idle machine)
    python bench/judge.py --quick         # smoke run: the tests' tiny model, few completions, short steps

1. judged completions per second at concurrency 1, 4 and 16 (distinct completions, cache off);
2. the wall time one GRPO step's batch (G=4, 6 prompts: 24 completions) waits for the judge, sequential
   (concurrency 1) vs concurrent (16), against the step time of the embedded recipe without a judge (2 steps of
   `recipes/gsm8k/embedded.yaml` on the same model, the second step's `step_time`);
3. the cache's hit rate on that batch asked twice.

The completions are the recipe's answer format with answers drawn around the right one (seeded, with the
duplicates a group of 4 has). Last line:
`judge: <x> completions/s at concurrency 16 (<y>x concurrency 1), step overhead <z>x without judge`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "recipes"))

from trl_grpo_ext.cpu.threads import apply_cpu_thread_defaults  # noqa: E402

apply_cpu_thread_defaults()


def completions_for(rows, per_prompt: int, seed: int) -> tuple[list, list]:
    """(prompts, completions): `per_prompt` answers per row in the one-shot format, some right, some off by a
    little, repeats included."""
    from trl_grpo_ext.task.answers import parse_ground_truth

    rng = random.Random(seed)
    prompts, completions = [], []
    for row in rows:
        right = int(float(parse_ground_truth(row["answer"])))
        for _ in range(per_prompt):
            answer = right + rng.choice([0, 0, 1, -1, 10])
            prompts.append(row["prompt"])
            completions.append([{"role": "assistant", "content": f"So the answer is \\boxed{{{answer}}}."}])
    return prompts, completions


LOOP = asyncio.new_event_loop()  # one loop for every call, as a training run has: the clients live across calls


def judged(judge, prompts, completions) -> tuple[float, dict]:
    from trl_grpo_ext.grpo.reward_aggregation import RewardMetricLog

    log = RewardMetricLog()
    start = time.perf_counter()
    LOOP.run_until_complete(judge(completions, prompts=prompts, log_metric=log))
    return time.perf_counter() - start, log.metrics()


def step_time_without_judge(model: str, quick: bool) -> float:
    """The second step's ``step_time`` of the embedded recipe on `model` with its rule rewards (G=4, 6 prompts)."""
    import gsm8k_grpo

    with tempfile.TemporaryDirectory() as out:
        argv = ["--model_name_or_path", model, "--max_steps", "2", "--eval_num_samples", "0", "--output_dir", out,
                "--disable_tqdm", "true"]  # fmt: skip
        if quick:
            argv += ["--max_completion_length", "8"]
        if gsm8k_grpo.main(argv) != 0:
            raise SystemExit("the recipe without a judge failed")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return float(rows[-1]["step_time"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="judge and policy model: 'embedded' or a folder")
    parser.add_argument("--completions", type=int, default=48, help="completions per throughput measurement")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 completions, short steps")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a `transformers serve` flag, e.g. --serve-arg=--continuous-batching",
    )
    args = parser.parse_args(argv)

    from judge_servers import TransformersServe

    from trl_grpo_ext.models import resolve_model
    from trl_grpo_ext.task.data import load_dataset_split
    from trl_grpo_ext.task.rewards import make_judge_reward

    tmp = tempfile.TemporaryDirectory()
    if args.quick:
        from conftest import build_tiny_model

        model = build_tiny_model(Path(tmp.name) / "tiny")
        args.completions = 8
    else:
        model = resolve_model(args.model)
    rows = list(load_dataset_split("synthetic", "train", num_samples=max(6, args.completions // 4), chat=True, seed=0))
    options = dict(model="auto", rubric_file=str(ROOT / "recipes/gsm8k/judge_rubric.md"), max_tokens=4, retries=1)

    with TransformersServe(
        model, timeout=300, log_path=str(Path(tmp.name) / "serve.log"), extra_args=args.serve_arg
    ) as server:

        def judge(concurrency: int, cache: bool):
            j = make_judge_reward({**options, "base_url": server.base_url, "max_concurrency": concurrency})
            j.config.cache = cache
            j.preflight()
            return j

        prompts, completions = completions_for(rows, 4, seed=0)
        distinct = {json.dumps(c): (p, c) for p, c in zip(prompts, completions, strict=True)}
        pool = list(distinct.values())[: args.completions]
        judged(judge(1, False), [pool[0][0]], [pool[0][1]])  # the server's first request loads nothing twice
        rates = {}
        for concurrency in (1, 4, 16):
            seconds, metrics = judged(judge(concurrency, False), [p for p, _ in pool], [c for _, c in pool])
            rates[concurrency] = len(pool) / seconds
            print(f"concurrency {concurrency:2d}: {rates[concurrency]:.1f} completions/s ({len(pool)} in {seconds:.2f} s, "
                  f"p50 {metrics.get('judge/latency_p50', 0):.3f} s, p99 {metrics.get('judge/latency_p99', 0):.3f} s)")  # fmt: skip

        step_prompts, step_completions = completions_for(rows[:6], 4, seed=1)  # G=4, 6 prompts
        waits = {}
        for concurrency in (1, 16):
            waits[concurrency], _ = judged(judge(concurrency, True), step_prompts, step_completions)
        cached = judge(16, True)
        judged(cached, step_prompts, step_completions)
        _, again = judged(cached, step_prompts, step_completions)
        hit_rate = again["judge/cache_hits"] / len(step_completions)
        print(f"step batch (G=4, 6 prompts): judge wait {waits[1]:.2f} s sequential, {waits[16]:.2f} s at "
              f"concurrency 16 ({waits[1] / waits[16]:.1f}x); repeated batch cache hit rate {hit_rate:.2f}")  # fmt: skip
    step = step_time_without_judge(model, args.quick)
    overhead = (step + waits[16]) / step
    print(f"step without judge: {step:.2f} s; with the judge at concurrency 16: {step + waits[16]:.2f} s")
    print(
        f"judge: {rates[16]:.1f} completions/s at concurrency 16 ({rates[16] / rates[1]:.1f}x concurrency 1), "
        f"step overhead {overhead:.2f}x without judge"
    )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
