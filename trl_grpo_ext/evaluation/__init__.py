"""Accuracy of a model on GSM8K-style problems: greedy pass@1, sampled maj@k and pass@k, before vs after.

One greedy eval serves both `trl-grpo-ext eval` and the recipes' before/after eval (`BeforeAfterEvalCallback`):
`evaluate` over a `Generator`, whose one implementation for `transformers` models is `HFGenerator` (a model
loaded from a path, or one in memory via `HFGenerator.borrowing`). The "before" eval of a model on an eval set
is cached on disk (`cached_greedy_eval`), keyed by the model's files, the eval set and the generation settings.

- `problems`: `Problem`s from GSM8K-schema rows or recipe dicts, and the eval data sources (`load_rows`);
- `scoring`: answers parsed as the `boxed` reward parses them, and format-independently; accuracies;
- `runner`: `evaluate` (batches, progress bar) over a `Generator`;
- `generator`: `HFGenerator`;
- `cache`: model identities and the cached "before" evals;
- `paired`: per-problem flips and paired gains (interval, McNemar) between two evals of the same problems;
- `results`: per-problem results on disk;
- `summary`: how results and gains read (lines, the eval summary table);
- `options`: the eval options (`EvalOptions`, `EvalRun`) the CLI, the sweeps and the recipes read;
- `command`: `run_eval`, the work of one `trl-grpo-ext eval`.
"""

from trl_grpo_ext.evaluation.cache import (
    cached_greedy_eval,
    eval_cache_dir,
    eval_cache_key,
    eval_set_hash,
    folder_identity,
    live_model_identity,
    live_model_settings,
    load_cached_eval,
    local_model_folder,
    model_identity,
    store_cached_eval,
)
from trl_grpo_ext.evaluation.command import run_eval
from trl_grpo_ext.evaluation.generator import HFGenerator
from trl_grpo_ext.evaluation.options import (
    RECIPE_EVAL_BATCH_SIZE,
    EvalOptions,
    EvalRun,
    add_eval_arguments,
    eval_cli_args,
    eval_run_from_args,
    recipe_eval_options,
    sweep_eval_options,
)
from trl_grpo_ext.evaluation.paired import compare_results, paired_comparison, paired_gain
from trl_grpo_ext.evaluation.problems import (
    EMBEDDED_DATA,
    GSM8K_TEST,
    HELDOUT_SEED,
    Problem,
    Prompt,
    as_problems,
    load_rows,
    problems_from_rows,
)
from trl_grpo_ext.evaluation.results import read_results, write_results
from trl_grpo_ext.evaluation.runner import Generator, evaluate
from trl_grpo_ext.evaluation.scoring import (
    HELDOUT_METRICS,
    ProblemResult,
    extract_any_prediction,
    extract_prediction,
    greedy_summary,
    is_correct,
    majority_vote,
    score_problem,
    summarize,
)
from trl_grpo_ext.evaluation.summary import format_gain, format_paired, format_summary, heldout_line, heldout_lines

__all__ = [
    "EMBEDDED_DATA",
    "GSM8K_TEST",
    "HELDOUT_METRICS",
    "HELDOUT_SEED",
    "RECIPE_EVAL_BATCH_SIZE",
    "EvalOptions",
    "EvalRun",
    "Generator",
    "HFGenerator",
    "Problem",
    "ProblemResult",
    "Prompt",
    "add_eval_arguments",
    "as_problems",
    "cached_greedy_eval",
    "compare_results",
    "eval_cache_dir",
    "eval_cache_key",
    "eval_cli_args",
    "eval_run_from_args",
    "eval_set_hash",
    "evaluate",
    "extract_any_prediction",
    "extract_prediction",
    "folder_identity",
    "format_gain",
    "format_paired",
    "format_summary",
    "greedy_summary",
    "heldout_line",
    "heldout_lines",
    "is_correct",
    "live_model_identity",
    "live_model_settings",
    "load_cached_eval",
    "load_rows",
    "local_model_folder",
    "majority_vote",
    "model_identity",
    "paired_comparison",
    "paired_gain",
    "problems_from_rows",
    "read_results",
    "recipe_eval_options",
    "run_eval",
    "score_problem",
    "store_cached_eval",
    "summarize",
    "sweep_eval_options",
    "write_results",
]
