"""The math-verify worker: symbolic comparisons in a process pool, each bounded by the CPU time it uses.

`VERIFIER` (a `MathVerifyWorker`), which `equality.answers_match` calls only for input within the symbolic limits,
runs math-verify in a `pebble.ProcessPool` of one worker process. Why a process: sympy can run for minutes on some
input, and a process can be stopped without touching the caller; it also works from any thread (TRL runs async
reward functions in worker threads). The worker is spawned (a fresh interpreter, never a fork of a multi-threaded
trainer); as with any spawned process, the main script is imported again there under ``__mp_main__``, so a script
that scores symbolic answers at import time keeps its work under ``if __name__ == "__main__":``.

The limit of a comparison is the worker's CPU time on it, not the wall clock: on a loaded machine a worker that gets
a sliver of a core (a nice-19 test run beside two trainings: 0.2 s of sympy took over 10 s of wall time) would
otherwise be cut off, and the same answers would score differently. The kernel enforces it (``ITIMER_PROF``, whose
``SIGPROF`` ends the worker even inside C code); the wall clock only backs it up (a worker that stops running at
all), through pebble's per-task timeout, with a generous multiple. math-verify's own timeouts are off (they use
``signal.alarm``, which fails outside the main thread).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as WallTimeout

from pebble import ProcessExpired, ProcessPool

logger = logging.getLogger(__name__)

# Comparisons the worker makes when it starts, so sympy's first-use costs are paid before the first real one.
WARM_UP = [
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("x = 18", "18"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("x^2+1", "1+x^2"),
    ("(1, 2)", "(1,2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
]
# The wall-clock backstop of a comparison's CPU-time limit: limit x factor + seconds.
WALL_BACKSTOP_FACTOR = 30.0
WALL_BACKSTOP_S = 60.0
# How a worker that used up its CPU time ends (the default action of SIGPROF), as multiprocessing reports it.
CPU_LIMIT_EXITCODE = -signal.SIGPROF


def check(pred: str, gold: str) -> bool:
    """math-verify's verdict on two normalised answers (in the calling process, without timeouts)."""
    from math_verify import parse, verify

    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


# ---------------------------------------------------------------------------------------------- in the worker


def _start_worker(compare: Callable[[str, str], bool], warm_up: tuple) -> None:
    """Pool initializer: quiet logs and warnings, SIGPROF ends the process, the warm-up comparisons."""
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    for pred, gold in warm_up:
        compare(pred, gold)


def _ready() -> bool:
    return True


def _compare(compare: Callable[[str, str], bool], pred: str, gold: str, cpu_limit: float) -> bool:
    """`compare`'s verdict (an exception: not equal); the worker ends once it has used `cpu_limit` CPU seconds."""
    signal.setitimer(signal.ITIMER_PROF, cpu_limit)
    try:
        return bool(compare(pred, gold))
    except BaseException:  # noqa: BLE001 - whatever sympy raises (even SystemExit) means "not shown equal"
        return False
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


# ---------------------------------------------------------------------------------------------- the client


class MathVerifyWorker:
    """Client of a one-worker process pool.

    One comparison at a time (a lock). Each may use `timeout` seconds of the worker's CPU time (machine load does
    not count, nor does waiting for the lock or for start-up); a comparison that runs out gets None, and its worker
    has ended, so no late answer can reach another call and the next comparison runs in a fresh one. A worker that
    dies while answering is replaced and asked once more. Answers are kept (they are the same every time) so a
    repeated comparison does not ask again.

    `compare` runs in the worker (tests pass a stand-in; it must be importable by name), after the `warm_up` pairs.
    """

    def __init__(
        self,
        compare: Callable[[str, str], bool] = check,
        warm_up: Iterable[tuple[str, str]] = tuple(WARM_UP),
        startup_timeout: float = 300.0,
        max_results: int = 65_536,
    ):
        self.compare = compare
        self.warm_up_pairs = tuple(warm_up)
        self.startup_timeout = startup_timeout
        self.max_results = max_results
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self._owner_pid = os.getpid()
        self._ready = False
        self._failed = False
        self._closer_registered = False
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
                pool = self._started_pool()
                if pool is None:
                    return None
                backstop = timeout * WALL_BACKSTOP_FACTOR + WALL_BACKSTOP_S
                try:
                    future = pool.schedule(_compare, (self.compare, pred, gold, timeout), timeout=backstop)
                    found = future.result()
                except (ProcessExpired, WallTimeout) as error:
                    self._ready = False  # pebble starts a new worker; wait for it to be ready next time
                    if isinstance(error, ProcessExpired) and error.exitcode != CPU_LIMIT_EXITCODE:
                        self.stats["restarts"] += 1  # died while answering: ask a fresh worker once more
                        continue
                    self.stats["timeouts"] += 1
                    logger.warning(
                        "math-verify used over %.0f CPU s on %r vs %r; scored not equal and the worker restarted "
                        "(TRL_GRPO_EXT_VERIFY_TIMEOUT raises the limit)",
                        timeout,
                        pred[:80],
                        gold[:80],
                    )
                    return None
                except Exception as error:  # noqa: BLE001 - a broken pool: symbolic answers score 0 from now on
                    self._give_up(f"the math-verify worker pool failed ({type(error).__name__}: {error})")
                    return None
                self.stats["answered"] += 1
                self._remember(key, found)
                return found
            return None

    def warm_up(self) -> bool:
        """Start the worker and wait until it is ready; True when it is."""
        with self._lock:
            return self._started_pool() is not None

    def close(self) -> None:
        with self._lock:
            self._stop_pool()

    def forget_parent_worker(self) -> None:
        """In a forked child: drop the parent's pool (its threads and pipes are the parent's) and a lock another
        thread of the parent may have held at the fork; the child starts its own pool when needed."""
        self._lock = threading.Lock()
        self._pool, self._ready = None, False
        self._owner_pid = os.getpid()

    # internals (lock held) ----------------------------------------------------------------------
    def _started_pool(self) -> ProcessPool | None:
        if self._failed:
            return None
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # A spawned process still importing an unguarded main script (module docstring): multiprocessing forbids
            # starting processes here, and the parent scores its own answers.
            return None
        if self._owner_pid != os.getpid():  # forked child: the pool belongs to the parent
            self.forget_parent_worker()
        if self._pool is not None and not self._pool.active:  # broken (e.g. its idle worker was killed)
            self._stop_pool()
        if self._pool is None:
            self._pool = ProcessPool(
                max_workers=1,
                initializer=_start_worker,
                initargs=(self.compare, self.warm_up_pairs),
                context=multiprocessing.get_context("spawn"),
            )
            self._ready = False
            if not self._closer_registered:  # a live worker would keep the interpreter from exiting
                atexit.register(self.close)
                self._closer_registered = True
        if not self._ready:
            try:
                self._ready = self._pool.schedule(_ready).result(timeout=self.startup_timeout)
            except Exception as error:  # noqa: BLE001 - start-up timed out, the import or the warm-up failed
                self._give_up(f"the math-verify worker did not start ({type(error).__name__}: {error})")
        return self._pool if self._ready else None

    def _give_up(self, why: str) -> None:
        self._failed = True
        logger.warning("%s; symbolic answers will score 0.", why)
        self._stop_pool()

    def _remember(self, key, ok: bool) -> None:
        self._results[key] = ok
        if len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def _stop_pool(self) -> None:
        pool, self._pool = self._pool, None
        self._ready = False
        if pool is not None and self._owner_pid == os.getpid():
            pool.stop()
            pool.join(timeout=10.0)


VERIFIER = MathVerifyWorker()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=VERIFIER.forget_parent_worker)
