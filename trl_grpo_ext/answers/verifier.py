"""The math-verify worker: both ends of one persistent process that compares symbolic answers.

Run as `python -m trl_grpo_ext.answers.verifier`, this module is the worker: it reads one JSON request
`[id, pred, gold]` per line and writes `[id, equal]`, after printing `ready` once math-verify is
imported. math-verify's own timeouts are off (they use `signal.alarm`, which fails outside the main
thread); the client bounds each comparison instead. Imported, it is the client (`MathVerifyWorker`,
`VERIFIER`), which `equality.answers_match` calls only for input within the symbolic limits.

Why a process: sympy can run for minutes on some input, and a process can be killed without touching
the caller; it also works from any thread (TRL runs async reward functions in worker threads).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

# Comparisons the worker makes before saying `ready`, so sympy's first-use costs are paid at start-up.
WARM_UP = [
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("x = 18", "18"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("x^2+1", "1+x^2"),
    ("(1, 2)", "(1,2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
]


def check(pred: str, gold: str) -> bool:
    """math-verify's verdict on two normalised answers (in the calling process, without timeouts)."""
    from math_verify import parse, verify

    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def main() -> None:
    logging.disable(logging.CRITICAL)
    for pred, gold in WARM_UP:
        check(pred, gold)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            rid, pred, gold = json.loads(line)
        except (ValueError, TypeError):
            continue
        try:
            ok = check(pred, gold)
        except Exception:
            ok = False
        sys.stdout.write(json.dumps([rid, ok]) + "\n")
        sys.stdout.flush()


# How often a waiting comparison reads the worker's CPU time, and the wall-clock backstop of its limit.
CPU_POLL_S = 0.1
WALL_BACKSTOP_FACTOR = 30.0
WALL_BACKSTOP_S = 60.0


def _cpu_clock(pid: int):
    """A function giving the CPU seconds (user + system) process `pid` has used; +inf once it is gone."""
    import psutil  # declared in pyproject (and a dependency of accelerate); imported on first use

    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return lambda: float("inf")

    def seconds() -> float:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            return float("inf")
        return times.user + times.system

    return seconds


class MathVerifyWorker:
    """Client of one persistent worker process.

    One comparison at a time (a lock); each waits for its own answer until the worker has spent `timeout`
    seconds of CPU time on it (machine load does not count), so waiting for the lock or for start-up never uses up a
    comparison's time. A comparison that runs out of time gets None and the worker is killed, so its
    late answer cannot reach any other call; the next comparison starts a fresh worker. A worker that
    dies while answering is restarted and asked once more. Answers are kept (they are the same every
    time) so a repeated comparison does not ask again.

    `command` is the worker's command line (tests pass a stand-in)."""

    def __init__(self, command: list[str] | None = None, startup_timeout: float = 300.0, max_results: int = 65_536):
        self.command = command or [sys.executable, "-m", __name__]
        self.startup_timeout = startup_timeout
        self.max_results = max_results
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self._ready = False
        self._failed = False
        self._buf = b""
        self._next_id = 0
        self._results: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self.stats = {"calls": 0, "answered": 0, "timeouts": 0, "restarts": 0}

    def check(self, pred: str, gold: str, timeout: float) -> bool | None:
        """math-verify's verdict, or None when the worker is unavailable or used over `timeout` CPU seconds."""
        key = (pred, gold)
        with self._lock:
            cached = self._results.get(key)
            if cached is not None:
                return cached
            self.stats["calls"] += 1
            for _attempt in range(2):  # a worker that died gets one retry
                if not self._ensure_started():
                    return None
                found = self._ask(key, timeout)
                if found is not None:
                    self.stats["answered"] += 1
                    self._remember(key, found)
                    return found
                if self._proc is not None:  # alive but out of time: kill it so its answer never arrives
                    self.stats["timeouts"] += 1
                    logger.warning(
                        "math-verify used over %.0f CPU s on %r vs %r; scored not equal and the worker restarted "
                        "(TRL_GRPO_EXT_VERIFY_TIMEOUT raises the limit)",
                        timeout,
                        pred[:80],
                        gold[:80],
                    )
                    self._kill()
                    return None
                self.stats["restarts"] += 1  # died while answering: ask a fresh worker once more
            return None

    def warm_up(self) -> bool:
        """Start the worker and wait until it is ready; True when it is."""
        with self._lock:
            return self._ensure_started()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def forget_parent_worker(self) -> None:
        """In a forked child: drop the parent's worker (its pipes are the parent's) and a lock another
        thread of the parent may have held at the fork; the child starts its own worker when needed."""
        self._lock = threading.Lock()
        self._proc, self._ready, self._buf = None, False, b""
        self._owner_pid = os.getpid()

    # internals (lock held) ----------------------------------------------------------------------
    def _ensure_started(self) -> bool:
        if self._failed:
            return False
        if self._owner_pid != os.getpid():  # forked child: the pipes belong to the parent's worker
            self._proc, self._ready, self._buf = None, False, b""
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
            if self._proc is None:
                return False
        if not self._ready:
            line = self._readline(time.monotonic() + self.startup_timeout)
            if line == b"ready":
                self._ready = True
            else:
                self._failed = True
                logger.warning("math-verify worker did not start; symbolic answers will score 0.")
                self._kill()
        return self._ready

    def _spawn(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # so `-m trl_grpo_ext...` works from any cwd
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                bufsize=0,
            )
        except OSError as err:
            self._failed = True
            self._proc = None
            logger.warning("math-verify worker could not start (%s); symbolic answers will score 0.", err)
            return
        self._owner_pid = os.getpid()
        self._ready = False
        self._buf = b""

    def _ask(self, key: tuple[str, str], timeout: float) -> bool | None:
        rid = self._next_id
        self._next_id += 1
        try:
            os.write(self._proc.stdin.fileno(), (json.dumps([rid, key[0], key[1]]) + "\n").encode())
        except OSError:
            self._kill()
            return None
        # The limit is the worker's CPU time on this comparison, not the wall clock: on a loaded machine a
        # worker that gets a sliver of a core (a nice-19 test run beside two trainings: 0.2 s of sympy took
        # over 10 s of wall time) would otherwise be cut off, and the same answers would score differently.
        # The wall clock only backs it up (a worker that stops running at all) with a generous multiple.
        cpu_seconds = _cpu_clock(self._proc.pid)
        cpu_start = cpu_seconds()
        wall_deadline = time.monotonic() + timeout * WALL_BACKSTOP_FACTOR + WALL_BACKSTOP_S
        while self._proc is not None:
            line = self._readline(min(wall_deadline, time.monotonic() + CPU_POLL_S))
            if line is None:
                if self._proc is None:  # died
                    return None
                if cpu_seconds() - cpu_start > timeout or time.monotonic() >= wall_deadline:
                    return None
                continue
            try:
                got, ok = json.loads(line)
            except (ValueError, TypeError):
                continue
            if got == rid:  # only this call's answer; anything else is stale
                return bool(ok)
        return None

    def _readline(self, deadline: float) -> bytes | None:
        """One line from the worker, waiting until `deadline`; None on timeout or when it died."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65_536)
            if not chunk:  # worker died
                self._kill()
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.strip()

    def _remember(self, key, ok: bool) -> None:
        self._results[key] = ok
        if len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self._ready = False
        self._buf = b""
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass


VERIFIER = MathVerifyWorker()
atexit.register(VERIFIER.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=VERIFIER.forget_parent_worker)


if __name__ == "__main__":
    main()
