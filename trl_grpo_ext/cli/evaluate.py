"""`trl-grpo-ext eval`: GSM8K-style accuracy of a model (greedy pass@1 boxed and format-independent, sampled maj@k and
pass@k); with --compare_model, the paired gain over it with its 95% interval. Greedy-only evals are cached."""

from __future__ import annotations

import sys

from trl_grpo_ext.evaluation import add_eval_arguments, eval_run_from_args, format_summary, run_eval
from trl_grpo_ext.runs import eval_summary_path


def add_arguments(parser) -> None:
    add_eval_arguments(parser)  # one flag per field of `evaluation.EvalRun`


def run(args) -> int:
    try:
        cfg = eval_run_from_args(args)
        print(cfg.engine_line(), flush=True)
        payload = run_eval(cfg)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(payload))
    print(f"\nper-problem results: {args.out}; summary: {eval_summary_path(args.out)}")
    return 0
