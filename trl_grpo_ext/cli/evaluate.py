"""`trl-grpo-ext eval`: GSM8K-style accuracy of a model (greedy pass@1 boxed and format-independent, sampled maj@k and
pass@k); with --compare_model, the paired gain over it with its 95% interval. Greedy-only evals are cached."""

from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", required=True, help="'embedded', a local path or a hub id (a run's output_dir works)"
    )
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder to apply on top of --model")
    parser.add_argument(
        "--data",
        default="embedded",
        help="'embedded' (offline reasoning-gym eval split), 'gsm8k-test', or a JSONL of question/answer rows",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        help="with --data embedded: reasoning-gym task mix, as the recipe's synthetic_tasks (e.g. chain_sum_easy,chain_sum)",
    )
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
    parser.add_argument("--k", type=int, default=1, help="samples per problem for maj@k / pass@k (1: greedy only)")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=8, help="problems per generate() call")
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature for the k samples")
    parser.add_argument("--top_p", "--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no_one_shot",
        "--no-one-shot",
        dest="one_shot",
        action="store_false",
        help="prompt without the one-shot worked example (the training default includes it)",
    )
    parser.add_argument(
        "--out",
        default="eval_results.jsonl",
        help="per-problem results (JSONL); the summary goes next to it as <stem>_summary.json",
    )
    parser.add_argument(
        "--compare_model",
        "--compare-model",
        default=None,
        help="a second model evaluated on the same problems as the 'before' model",
    )
    parser.add_argument(
        "--no_cache",
        "--no-cache",
        dest="cache",
        action="store_false",
        help="always generate: do not read or write the greedy-eval cache ($TRL_GRPO_EXT_CACHE/eval)",
    )
    parser.add_argument("--no-progress", "--no_progress", dest="progress", action="store_false")


def run(args) -> int:
    from trl_grpo_ext.evaluation import EvalRun, format_summary, run_eval, summary_path_for

    cfg = EvalRun(
        model=args.model,
        data=args.data,
        adapter=args.adapter,
        compare_model=args.compare_model,
        limit=args.limit,
        k=args.k,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        one_shot=args.one_shot,
        tasks=args.tasks,
        out=args.out,
        progress=args.progress,
        cache=args.cache,
    )
    try:
        payload = run_eval(cfg)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(payload))
    print(f"\nper-problem results: {args.out}; summary: {summary_path_for(args.out)}")
    return 0
