"""Sampling beside training: the two sides of the local server's model, each with its own module tree, lock and cores.

PEFT keeps the active adapter in the model's LoRA layers, so one model object serves one adapter at a time: with a
single lock, a decode step waited for a whole ``forward_backward``. Here the sampling side (sampler snapshots:
``sample``, ``compute_logprobs``, the OpenAI route) runs on a second module tree whose parameters and buffers *are*
the training tree's (`shared_weights_copy`: the same tensors, no second copy of the base weights; they are frozen),
so it has LoRA layers of its own (its sampler slots) and runs while a training run's forward/backward or optimizer
step holds the other. Each side holds its own `ModelLock`.

On a CPU each side runs on its own share of the cores (`thread_shares`): torch's thread count is OpenMP's setting of
the calling thread, so a side's lock sets it in the thread that holds it, and two sides never oversubscribe the
machine. Computation is unchanged: a side computes what the single-lock server computes with the same thread count,
bit for bit (tests/test_pytrio_server_concurrency.py).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch


def shared_weights_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree (its own modules, configs and hooks) whose parameters and buffers are
    `model`'s own tensors. Take it before PEFT wraps either tree."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def thread_shares(total: int) -> tuple[int, int]:
    """(sampling, training) threads out of `total`: half each, training the odd one; at least one each."""
    sampling = max(1, total // 2)
    return sampling, max(1, total - sampling)


class ModelLock:
    """One side's hold on the model: a re-entrant lock that, where `threads` is given (on a CPU), also runs torch in
    the holding thread with ``threads()`` threads (read at every acquisition: it may follow the machine's load)."""

    def __init__(self, threads: Callable[[], int] | None = None):
        self._lock = threading.RLock()
        self.threads = threads

    def __enter__(self) -> ModelLock:
        self._lock.acquire()
        if self.threads is not None:
            wanted = self.threads()
            # the first read also makes torch set this thread up (ATen's lazy per-thread init would otherwise apply
            # the last count any thread set at this thread's first parallel op, overriding ours)
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
