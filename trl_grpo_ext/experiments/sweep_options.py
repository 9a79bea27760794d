"""Where a sweep's runs execute (`launcher:`) and what each SLURM job asks for (`slurm:`), validated on load.

Part of the sweep file's schema (`trl_grpo_ext.experiments.sweep` reads it); `trl_grpo_ext.experiments.launch` acts on it. No project imports.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, fields

LAUNCHERS = ("local", "slurm")
# Sweep files written before `launcher: local | slurm` named the command that starts a recipe here; both still
# mean the local launcher, `accelerate` with `accelerate launch` (which `accelerate_config` now implies anyway).
LEGACY_LAUNCHERS = {"python": False, "accelerate": True}

# sbatch's --mem: a number with an optional K/M/G/T unit (megabytes without one).
_MEM_RE = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
# sbatch's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]], or no limit.
_TIME_RE = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
# Options the launcher sets itself: an array over the runs, and where each task's output goes.
_OWN_SBATCH_OPTIONS = ("--array", "-a", "--output", "-o", "--error", "-e", "--parsable", "--wrap")


@dataclass
class SlurmOptions:
    """The `slurm:` mapping of a sweep file: what each run's job asks the scheduler for."""

    partition: str | None = field(default=None, metadata={"help": "sbatch --partition (None: the cluster default)"})
    gpus_per_run: int | None = field(
        default=None,
        metadata={
            "help": "GPUs per TRL run (--gres=gpu:N); more than 1 starts the recipe with `accelerate launch "
            "--num_processes N`. None: 1, or 0 for a run whose config says use_cpu. PyTRIO runs never ask for one."
        },
    )
    cpus_per_run: int | None = field(
        default=None,
        metadata={"help": "sbatch --cpus-per-task; also the job's OMP_NUM_THREADS (None: cluster default)"},
    )
    mem: str | None = field(default=None, metadata={"help": "sbatch --mem per run, e.g. 64G (None: cluster default)"})
    time: str | None = field(
        default=None, metadata={"help": "sbatch --time per run, e.g. '4:00:00' or '1-12:00:00' (quote it in YAML)"}
    )
    account: str | None = field(default=None, metadata={"help": "sbatch --account"})
    qos: str | None = field(default=None, metadata={"help": "sbatch --qos"})
    extra_sbatch_args: list[str] = field(
        default_factory=list, metadata={"help": "more sbatch options, e.g. ['--constraint=a100', '--exclusive']"}
    )

    def __post_init__(self):
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value)
            ):
                raise ValueError(f"slurm.{name} must be one word, got {value!r}")
        for name, low in (("gpus_per_run", 0), ("cpus_per_run", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"slurm.{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.mem, int) and not isinstance(self.mem, bool):
            self.mem = str(self.mem)  # sbatch reads a bare number as megabytes
        if self.mem is not None and not (isinstance(self.mem, str) and _MEM_RE.fullmatch(self.mem)):
            raise ValueError(f"slurm.mem must be a size such as 16G or 4000M, got {self.mem!r}")
        if self.time is not None and not isinstance(self.time, str):
            # YAML 1.1 reads 1:30:00 as the number 5400 (base 60), 30 as 30: neither says which unit was meant.
            raise ValueError(
                f"slurm.time must be a quoted string such as '1:30:00' or '90' (minutes), got {self.time!r}"
            )
        if self.time is not None and not _TIME_RE.fullmatch(self.time.strip()):
            raise ValueError(f"slurm.time {self.time!r} is not a SLURM time (minutes, H:MM:SS or D-HH:MM:SS)")
        if isinstance(self.extra_sbatch_args, str):
            self.extra_sbatch_args = shlex.split(self.extra_sbatch_args)
        if not isinstance(self.extra_sbatch_args, list) or not all(isinstance(a, str) for a in self.extra_sbatch_args):
            raise ValueError(f"slurm.extra_sbatch_args must be a list of strings, got {self.extra_sbatch_args!r}")
        for arg in self.extra_sbatch_args:
            if arg.split("=", 1)[0] in _OWN_SBATCH_OPTIONS:
                raise ValueError(
                    f"slurm.extra_sbatch_args: {arg.split('=', 1)[0]} is set by the sweep for its job arrays"
                )

    @classmethod
    def from_mapping(cls, data, where: str = "") -> SlurmOptions:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"{where}'slurm' must be a mapping of {sorted(f.name for f in fields(cls))}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{where}unknown slurm keys {sorted(unknown)}; known keys: {sorted(known)}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
