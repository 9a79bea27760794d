"""CPU threads, in one place: the OpenMP setting every recipe and CLI applies when the user set none, and the cores
a single-process CPU run gets back from `accelerate launch`.

OpenMP threads that finish their share of a parallel region spin, waiting for the next one (the GNU runtime torch
ships spins ~300k iterations before sleeping). On an idle machine that saves a wake-up; beside another busy process
the spinning threads take the cores the working thread needs, and a step slows several-fold (issue 19: `make
train`'s 2-thread default ran 100 s a step beside one busy process, 18 s with one thread, ~12 s idle).
``GOMP_SPINCOUNT=10000`` keeps a short spin (tens of microseconds) and then sleeps: an idle machine keeps the
spin's benefit between back-to-back regions, a loaded one degrades to about the speed of the cores it has left.
Measured side by side in one run (`bench/cpu_threads.py`, docs/recipes.md#cpu-threads): ``OMP_WAIT_POLICY=PASSIVE``
(sleep at once) degrades best under load but cost 6-16% idle, over the 5% budget; the short spin lost 0-3% idle
and avoids the collapse, though beside a busy process it ran 0.84-1.0x one thread. The thread count is left as it is (torch's default, or every core for a single-process run,
`configure_cpu_threads`): fewer threads would cost an idle machine far more than 5%. Only GNU OpenMP (torch's Linux
wheels) reads ``GOMP_SPINCOUNT``; builds on LLVM or Intel OpenMP (macOS) keep their own default.

OpenMP reads its settings when torch's runtime loads (``import torch``), so `apply_cpu_thread_defaults` runs
first thing in the recipes' scripts and the `trl-grpo-ext` console script; set in ``os.environ``, it also reaches
every process those start (accelerate's workers, sweep runs, the PyTRIO server).
"""

from __future__ import annotations

import os
from pathlib import Path

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


def cpu_threads_to_set(env, launcher, cpu_count: int, on_cpu: bool) -> int | None:
    """Torch threads for a single-process CPU run that `accelerate launch` started with OMP_NUM_THREADS it chose
    itself (1 unless `use_cpu` and several physical cores), or None to keep the current setting.

    `accelerate launch` always exports OMP_NUM_THREADS to the script, so the script cannot tell a user's value
    from accelerate's; the launcher's own environment and arguments (`launcher`: (env, argv)) can: accelerate
    only picks the value when neither OMP_NUM_THREADS nor --num_cpu_threads_per_process was given to it.
    """
    if not on_cpu or "ACCELERATE_DYNAMO_BACKEND" not in env or launcher is None:
        return None  # not started by accelerate's launcher (a plain `python` run keeps torch's default)
    if int(env.get("WORLD_SIZE") or 1) > 1 or int(env.get("LOCAL_WORLD_SIZE") or 1) > 1:
        return None  # several processes share the cores
    launcher_env, launcher_argv = launcher
    if "OMP_NUM_THREADS" in launcher_env:
        return None
    if any(
        a == "--num_cpu_threads_per_process" or a.startswith("--num_cpu_threads_per_process=") for a in launcher_argv
    ):
        return None
    return cpu_count


def configure_cpu_threads(training_args) -> int:
    """Give a single-process CPU run every core `accelerate launch` held back (see `cpu_threads_to_set`); returns
    the torch thread count in effect."""
    import torch

    on_cpu = bool(getattr(training_args, "use_cpu", False)) or not torch.cuda.is_available()
    threads = cpu_threads_to_set(os.environ, _launcher_process(), usable_cores(), on_cpu)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
