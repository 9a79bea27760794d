"""CPU threads, in one place: the OpenMP setting every recipe and CLI applies when the user set none, the cores a
single-process CPU run gets back from `accelerate launch`, and the thread count that follows the machine's load.

OpenMP threads that finish their share of a parallel region spin, waiting for the next one (the GNU runtime torch
ships spins ~300k iterations before sleeping). Beside another busy process they take the cores the working thread
needs, and a step slows several-fold (`make train`'s 2 threads ran 100 s a step beside one busy process,
18 s with one thread, ~12 s idle). No fixed setting keeps both an idle and a loaded machine's speed (`bench/
cpu_threads.py`, docs/recipes.md#cpu-threads): every core is best idle, one thread fewer per busy core is best
loaded. So:

- ``GOMP_SPINCOUNT=10000`` (`apply_cpu_thread_defaults`): a short spin, then sleep, unless the user chose how OpenMP
  threads wait (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``). Only GNU OpenMP (torch's Linux wheels)
  reads it. OpenMP reads it when torch loads, so it runs first thing in the recipes' scripts and the `trl-grpo-ext`
  console script; set in ``os.environ``, it also reaches every process those start (accelerate's workers, sweep
  runs, the PyTRIO server).
- `configure_cpu_threads`: a single-process CPU run under `accelerate launch` gets every core back (accelerate
  exports ``OMP_NUM_THREADS=1`` unless told otherwise).
- `govern_cpu_threads` (the "governor"): where a CPU model is loaded (the TRL recipe, `evaluate`'s generator, the
  PyTRIO server's engine, whose sampling and training sides take shares of the count in their locks instead of the
  hook), a forward pre-hook on the model sets torch's thread count, at most once a second, to the
  cores other processes left free: ``max(1, min(cap, cores - others))``, ``cap`` being the count in effect when it was
  installed (it never raises it). ``others`` is the cores the rest of the machine kept busy over that second
  (/proc/stat's busy time on this process's CPUs less this process's own, /proc/self/stat); a core counts once
  others used more than half of it on average, so a short shell command does not flip it. It runs in the forward's
  thread because ``torch.set_num_threads`` sets OpenMP's count for the calling thread only (backward and the
  optimizer step run on that thread too). Linux only (/proc); elsewhere, and where the count is 1, nothing is
  installed.

Results: the count changes how fast a step runs and, for most of what a run computes, nothing else. On the CPU
torch's fp32 matrix products and sdpa attention (forward and backward) gave the same bits at 1 and 2 threads, and so
do the shared-prefix engine's gathers (`trl_grpo_ext.prefix.attention.take`), so an fp32 run with sdpa attention
gives the same figures whether or not the count moved (the embedded recipe, 3 steps at a fixed 1 and 2 threads:
every logged figure equal to the last digit, on a 2-core AVX2 machine; MKL picks its kernels per CPU). Where an op
splits its work by thread count, a changed count moves figures in the last digits, and sampled completions can then
part ways: torch's softmax backward (eager attention) and its whole-tensor sums of 32,768 or more elements do, and
bf16's oneDNN kernels were not checked at different counts. A run that must repeat bit for bit sets
``TRL_GRPO_EXT_CPU_THREADS=fixed`` with a fixed ``OMP_NUM_THREADS``: the same inputs at the same count give the same
figures whatever the load. When the count changed, the run summary says so and how (`summary_lines`).

The governor is installed unless the user chose the thread count: ``TRL_GRPO_EXT_CPU_THREADS=fixed`` keeps whatever
count is set, ``=auto`` governs even so; with neither, an ``OMP_NUM_THREADS`` the user exported (to the script, or to
`accelerate launch`, or its ``--num_cpu_threads_per_process``) is kept as their choice, as TRL users expect, while
the 1 that `accelerate launch` picks by itself is not (`make train` passes ``--num_cpu_threads_per_process $(nproc)``
and ``TRL_GRPO_EXT_CPU_THREADS=auto``, ``=fixed`` with ``make train CPU_THREADS=fixed``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Defaults applied when the user set none of `USER_SETTINGS`.
DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
# Any of these means the user chose how OpenMP threads wait (GNU's spin count, Intel's block time): left alone.
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_cpu_thread_defaults(environ=None) -> dict[str, str]:
    """Set `DEFAULTS` in `environ` (``os.environ``) unless the user set any of `USER_SETTINGS`; returns what it set.

    Takes effect in this process only if torch has not been imported yet, and always in the processes started
    after it.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in USER_SETTINGS):
        return {}
    env.update(DEFAULTS)
    return dict(DEFAULTS)


# ------------------------------------------------------------------ the cores `accelerate launch` held back


def _launcher_process() -> tuple[dict, list[str]] | None:
    """(environment at exec, argv) of the parent process when it is `accelerate launch`, else None (Linux /proc)."""
    try:
        parent = Path(f"/proc/{os.getppid()}")
        argv = [a.decode(errors="replace") for a in (parent / "cmdline").read_bytes().split(b"\0") if a]
        raw = (parent / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if not any("accelerate" in part for part in argv[:3]):
        return None
    env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
    return env, argv


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _accelerate_chose_threads(env, launcher) -> bool:
    """True when `accelerate launch` started this process and picked OMP_NUM_THREADS itself.

    `accelerate launch` always exports OMP_NUM_THREADS to the script, so the script cannot tell a user's value
    from accelerate's; the launcher's own environment and arguments (`launcher`: (env, argv)) can: accelerate
    only picks the value when neither OMP_NUM_THREADS nor --num_cpu_threads_per_process was given to it.
    """
    if "ACCELERATE_DYNAMO_BACKEND" not in env or launcher is None:
        return False  # not started by accelerate's launcher
    launcher_env, launcher_argv = launcher
    if "OMP_NUM_THREADS" in launcher_env:
        return False
    flag = "--num_cpu_threads_per_process"
    return not any(a == flag or a.startswith(flag + "=") for a in launcher_argv)


def cpu_threads_to_set(env, launcher, cpu_count: int, on_cpu: bool) -> int | None:
    """Torch threads for a single-process CPU run that `accelerate launch` started with OMP_NUM_THREADS it chose
    itself (1 unless `use_cpu` and several physical cores), or None to keep the current setting (a plain `python`
    run keeps torch's default; see `_accelerate_chose_threads`)."""
    if not on_cpu or not _accelerate_chose_threads(env, launcher):
        return None
    if int(env.get("WORLD_SIZE") or 1) > 1 or int(env.get("LOCAL_WORLD_SIZE") or 1) > 1:
        return None  # several processes share the cores
    return cpu_count


def runs_on_cpu(training_args) -> bool:
    """Whether a recipe run trains on the CPU (``use_cpu``, or no GPU)."""
    import torch

    return bool(getattr(training_args, "use_cpu", False)) or not torch.cuda.is_available()


def configure_cpu_threads(training_args) -> int:
    """Give a single-process CPU run every core `accelerate launch` held back (see `cpu_threads_to_set`); returns
    the torch thread count in effect. Also rejects a bad ``TRL_GRPO_EXT_CPU_THREADS`` (ValueError) before any model
    loads."""
    import torch

    threads_mode(os.environ)
    threads = cpu_threads_to_set(os.environ, _launcher_process(), usable_cores(), runs_on_cpu(training_args))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# ------------------------------------------------------------------ the thread count that follows the machine's load

MODE_ENV = "TRL_GRPO_EXT_CPU_THREADS"
MODES = ("auto", "fixed")  # auto: follow the load (the default unless the user set OMP_NUM_THREADS); fixed: don't


def threads_mode(env) -> str | None:
    """The user's ``TRL_GRPO_EXT_CPU_THREADS`` ("auto" or "fixed"), None when unset; ValueError for anything else."""
    mode = env.get(MODE_ENV, "").strip().lower()
    if mode and mode not in MODES:
        raise ValueError(f"{MODE_ENV}={env[MODE_ENV]!r}: expected one of {', '.join(MODES)}")
    return mode or None


def governed(env, launcher) -> bool:
    """Whether the thread count may follow the load: yes unless the user chose it (module docstring)."""
    mode = threads_mode(env)
    if mode is not None:
        return mode == "auto"
    return "OMP_NUM_THREADS" not in env or _accelerate_chose_threads(env, launcher)


def _busy_fields(line: str) -> int:
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait (guest is inside user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in line.split()[1:9])
    return user + nice + system + irq + softirq + steal


def proc_reader(cpus=None):
    """A reading function for `CpuThreadGovernor`: () -> (busy jiffies of `cpus` (this process's CPUs), this
    process's own jiffies (all threads), monotonic wall seconds). Raises OSError where /proc is missing."""
    names = {f"cpu{c}" for c in (os.sched_getaffinity(0) if cpus is None else cpus)}

    def read() -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            busy = sum(_busy_fields(line) for line in f if line.split(" ", 1)[0] in names)
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return busy, int(fields[11]) + int(fields[12]), time.monotonic()  # utime, stime

    read()  # fails here, not in a forward, where /proc is missing
    return read


class CpuThreadGovernor:
    """Chooses the thread count from the cores other processes keep busy (module docstring); `check` is cheap
    (a clock read) except once per `interval_s`, when it reads /proc (tens of microseconds)."""

    def __init__(self, cap, cores, read, ticks_per_s, interval_s=1.0, margin=0.5, clock=time.monotonic):
        """`read`: () -> (busy jiffies of the cores, this process's jiffies, `clock()` seconds), e.g. `proc_reader`."""
        self.cap, self.cores, self.read, self.clock = cap, cores, read, clock
        self.ticks_per_s, self.interval_s, self.margin = ticks_per_s, interval_s, margin
        self.threads = cap  # the count to run at
        self.changes = 0
        self.lowest = cap
        self._last = read()
        self._lock = threading.Lock()

    @classmethod
    def for_this_process(cls, cap: int) -> CpuThreadGovernor | None:
        """Over /proc for this process's CPUs; None where /proc is missing or there is nothing to choose (cap 1)."""
        if cap <= 1 or not hasattr(os, "sched_getaffinity"):
            return None
        try:
            read = proc_reader()
        except (OSError, ValueError, IndexError):
            return None
        return cls(cap, usable_cores(), read, os.sysconf("SC_CLK_TCK"))

    def others(self, last, now) -> float:
        """Cores the rest of the machine kept busy between two readings, on average."""
        wall = now[2] - last[2]
        return ((now[0] - last[0]) - (now[1] - last[1])) / (wall * self.ticks_per_s)

    def wanted(self, others: float) -> int:
        """Threads for `others` busy cores: a core is taken once others use more than `margin` of it."""
        taken = max(0, math.ceil(others - self.margin))
        return max(1, min(self.cap, self.cores - taken))

    def summary_lines(self) -> list[str]:
        """What a run summary says when the count changed (nothing when it did not): which figures may then
        differ, and how to repeat a run bit for bit (module docstring, "Results")."""
        if not self.changes:
            return []
        return [
            f"  the torch thread count changed {self.changes} time(s) while other processes were busy (lowest "
            f"{self.lowest}): figures may differ in the last digits from an idle run's ({self.cap} threads throughout)",
            f"  to repeat a run bit for bit, fix the count: {MODE_ENV}=fixed OMP_NUM_THREADS={self.cap} (make train "
            "CPU_THREADS=fixed); when figures depend on the count: docs/recipes.md#cpu-threads",
        ]

    def check(self) -> int:
        """The count to run at now: re-chosen when `interval_s` has passed since the last reading."""
        if self.clock() - self._last[2] < self.interval_s or not self._lock.acquire(blocking=False):
            return self.threads
        try:
            now = self.read()
            if now[2] - self._last[2] < self.interval_s:  # another thread read meanwhile
                return self.threads
            threads = self.wanted(self.others(self._last, now))
            self._last = now
            if threads != self.threads:
                logger.debug("CPU threads %d -> %d (other processes' load)", self.threads, threads)
                self.threads, self.changes, self.lowest = threads, self.changes + 1, min(self.lowest, threads)
        except (OSError, ValueError, IndexError):
            self.interval_s = math.inf  # /proc went away: keep the count as it is
        finally:
            self._lock.release()
        return self.threads


_governor: CpuThreadGovernor | None = None


def current_governor() -> CpuThreadGovernor | None:
    """This process's governor, None when none was installed."""
    return _governor


def _pre_forward(module, args) -> None:
    """Forward pre-hook: run at the governor's count, in this (the forward's) thread. A module-level function, so
    a deep copy of the model (TRL's reference model) shares the one governor."""
    import torch

    if _governor is not None:
        threads = _governor.check()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def govern_cpu_threads(model, on_cpu: bool | None = None, hook: bool = True) -> CpuThreadGovernor | None:
    """Let `model`'s forwards on the CPU follow the machine's load (module docstring); returns the process's
    governor, or None when not installed (a GPU model, the user chose the thread count, no /proc, one thread).

    `on_cpu`: where the model will run; None: where its parameters are now. `hook=False` returns the governor
    without installing its hook: the caller sets the count from `CpuThreadGovernor.check` itself (the local PyTRIO
    server, whose sampling and training threads each take a share of it).
    """
    global _governor
    import torch

    if on_cpu is None:
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if not on_cpu or not governed(os.environ, _launcher_process()):
        return None
    if _governor is None:
        _governor = CpuThreadGovernor.for_this_process(torch.get_num_threads())
        if _governor is None:
            return None
    if hook and _pre_forward not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_pre_forward)
    return _governor


# ------------------------------------------------------------------ the cores of an asynchronous run's two sides


@dataclass(frozen=True)
class CoreSplit:
    """The cores and torch threads of a run whose sampler and trainer run at once, one thread each side of them.

    Both sides get the same thread count: ``torch.set_num_threads`` is per thread for OpenMP but sets MKL's count
    for the whole process, so unequal counts would keep changing each other's. On an odd count the trainer's side
    gets the spare core (its Python work: rewards, tokenizing, logging), not a thread."""

    trainer_cores: tuple[int, ...]
    sampler_cores: tuple[int, ...]
    threads: int

    def line(self) -> str:
        return (
            f"sampler on core(s) {_cores(self.sampler_cores)}, trainer on core(s) {_cores(self.trainer_cores)}, "
            f"{self.threads} torch thread(s) each"
        )


def _cores(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)


def split_cores(cores: tuple[int, ...] | None = None) -> CoreSplit | None:
    """Halves of this process's cores (`cores`: default its CPU affinity) for the trainer and the sampler; None
    with a single core (both sides then share it, as a synchronous run would)."""
    if cores is None:
        cores = (
            tuple(sorted(os.sched_getaffinity(0)))
            if hasattr(os, "sched_getaffinity")
            else tuple(range(usable_cores()))
        )
    cores = tuple(cores)
    if len(cores) < 2:
        return None
    threads = len(cores) // 2
    return CoreSplit(cores[: len(cores) - threads], cores[len(cores) - threads :], threads)


def pin_this_thread(cores: tuple[int, ...], threads: int) -> None:
    """Run the calling thread (and the OpenMP threads it starts) on `cores` with `threads` torch threads."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(threading.get_native_id(), cores)
    torch.set_num_threads(threads)
