"""Starting, tracking and stopping a sweep's runs, on this machine or through SLURM.

Every launcher starts the same job for a run (`launch/job.py`: `python -m trl_grpo_ext.experiments.launch.job RUN_DIR`),
which trains (resuming from the last complete checkpoint), evaluates and records how it ended in the run folder.
The run folders are the source of truth; the launchers only decide where and how many jobs run at once:

- `records.py`   a run's attempt record (what its job did, or is doing) and its state for `--status`
- `job.py`       the job description written into a run folder, and the job itself
- `local.py`     jobs as child processes of the sweep command, N at a time
- `slurm.py`     jobs as SLURM job arrays (sbatch / squeue / scancel; no accounting database needed)
- `runner.py`    the sweep command's side: pick runs to start, never one already queued or running, wait, summarize

The `launcher:` names and the sweep file's `slurm:` resources are `trl_grpo_ext.experiments.sweep_options` (the sweep file's
schema, below this package: `trl_grpo_ext.experiments.sweep` reads them).
"""


class LauncherError(RuntimeError):
    """A launcher cannot do what was asked (no sbatch here, squeue down, a refused submission): one line."""
