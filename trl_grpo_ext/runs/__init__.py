"""A run folder's files, for both execution paths: their names, readers and writers, and every write a kill must
not destroy.

- `names`: every file name of a run folder, a sweep and `trl-grpo-ext eval`'s outputs (spelled nowhere else);
- `files`: whole-file writes (`atomic_write_text`, `atomic_write_json`, `write_run_config`, `write_jsonl`) replace
  the old file in one rename, so a kill leaves either the old or the new file, never half of one;
- `metrics`: `metrics.jsonl` rows, appended after repairing a row a kill cut short, read skipping unreadable
  lines, truncated to a resumed run's checkpoint; `RunLogger`, the one writer of step metrics both execution
  paths call (rows, mirrored to SwanLab);
- `tracking`: SwanLab's mode and start-up for both paths, and `jsonable` (a metric value as a row holds it);
- `checkpoints`: the latest complete HF `checkpoint-N` (a save killed before its trainer_state.json is passed
  over) and the one `resume_from_checkpoint` names;
- `sweep_files`: a sweep's markers, configs, logs and summary;
- `folders`: finished run folders as `trl-grpo-ext compare` reads them.

Each guarantee is tested in tests/test_runs.py and tests/test_kill_resume.py.
"""

from trl_grpo_ext.runs.checkpoints import (
    checkpoint_folders,
    is_complete_checkpoint,
    latest_checkpoint,
    resolve_resume_checkpoint,
)
from trl_grpo_ext.runs.files import (
    atomic_write_json,
    atomic_write_text,
    load_yaml,
    read_jsonl,
    write_jsonl,
    write_run_config,
    yaml_loads,
)
from trl_grpo_ext.runs.metrics import RunLogger, append_jsonl_row, read_metrics_file, run_metrics, truncate_metrics
from trl_grpo_ext.runs.names import (
    ADAPTER_CONFIG_FILENAME,
    ASYNC_ROLLOUTS_FILENAME,
    CHECKPOINT_PATTERN,
    CHECKPOINT_PREFIX,
    CONFIG_FILENAME,
    CURRICULUM_STATE_FILENAME,
    EVAL_AFTER_PROBLEMS_FILENAME,
    EVAL_BEFORE_AFTER_FILENAME,
    EVAL_BEFORE_PROBLEMS_FILENAME,
    EVAL_LOG_FILENAME,
    EVAL_METRICS_FILENAME,
    EVAL_RESULTS_FILENAME,
    EVAL_SUMMARY_FILENAME,
    METRICS_FILENAME,
    MODEL_CONFIG_FILENAME,
    PYTRIO_SERVER_DIRNAME,
    PYTRIO_STATE_FILENAME,
    REWARD_CURVE_FILENAME,
    RUN_SUMMARY_FILENAME,
    SWANLAB_DIRNAME,
    SWEEP_CONFIG_FILENAME,
    SWEEP_DONE_FILENAME,
    SWEEP_LOG_FILENAME,
    SWEEP_SUMMARY_FILENAME,
    TRAIN_LOG_FILENAME,
    TRAINER_STATE_FILENAME,
    attempt_metrics_path,
    checkpoint_dir,
    eval_compare_path,
    eval_summary_path,
)

__all__ = [
    "load_yaml",
    "yaml_loads",
    "RunLogger",
    "ADAPTER_CONFIG_FILENAME",
    "ASYNC_ROLLOUTS_FILENAME",
    "CHECKPOINT_PATTERN",
    "CHECKPOINT_PREFIX",
    "CONFIG_FILENAME",
    "CURRICULUM_STATE_FILENAME",
    "EVAL_AFTER_PROBLEMS_FILENAME",
    "EVAL_BEFORE_AFTER_FILENAME",
    "EVAL_BEFORE_PROBLEMS_FILENAME",
    "EVAL_LOG_FILENAME",
    "EVAL_METRICS_FILENAME",
    "EVAL_RESULTS_FILENAME",
    "EVAL_SUMMARY_FILENAME",
    "METRICS_FILENAME",
    "MODEL_CONFIG_FILENAME",
    "PYTRIO_SERVER_DIRNAME",
    "PYTRIO_STATE_FILENAME",
    "REWARD_CURVE_FILENAME",
    "RUN_SUMMARY_FILENAME",
    "SWANLAB_DIRNAME",
    "SWEEP_CONFIG_FILENAME",
    "SWEEP_DONE_FILENAME",
    "SWEEP_LOG_FILENAME",
    "SWEEP_SUMMARY_FILENAME",
    "TRAINER_STATE_FILENAME",
    "TRAIN_LOG_FILENAME",
    "append_jsonl_row",
    "atomic_write_json",
    "atomic_write_text",
    "attempt_metrics_path",
    "checkpoint_dir",
    "checkpoint_folders",
    "eval_compare_path",
    "eval_summary_path",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "read_jsonl",
    "read_metrics_file",
    "resolve_resume_checkpoint",
    "run_metrics",
    "truncate_metrics",
    "write_jsonl",
    "write_run_config",
]
