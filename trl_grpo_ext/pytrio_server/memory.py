"""Memory admission of the local server: each request's working memory estimated from the model's shape, a budget
that admitted work never exceeds, and the allocator's memory handed back after a burst.

`MemoryModel` turns a request into bytes: forward/backward by the tokens of its largest padded chunk (the activations
autograd keeps, per layer and token, or only the layers' inputs where the chunk's layers are recomputed in backward),
sampling by its KV cache (prompt + samples x max_tokens) and the per-step vocabulary-wide tensors, prompt log-probs
by one forward. The figures per layer and token were measured on the embedded model (SmolLM2-135M: saved tensors of
a 2,048-token item counted with ``saved_tensors_hooks``, 2.9 GB: ~4.6 intermediate-wide, ~5.4 hidden-wide and
2 x (heads + kv heads) x head_dim values per layer and token), rounded up.

`MemoryGate` admits work against the budget: a request that can never fit is refused at once (413, the estimate and
the limit in the message); one that does not fit now waits (its training event in its run's worker, its sample
request in the batcher's queue) until running work releases enough. Waiters are served in order: small requests
do not overtake a waiting large one forever.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from trl_grpo_ext.pytrio_server.errors import ApiError

logger = logging.getLogger(__name__)

GIB = 1024**3
DEFAULT_BUDGET_FRACTION = 0.6  # of the memory available when the server starts, after the model loaded
# Allocations above this are mmapped by glibc, so a freed activation goes straight back to the system. glibc's
# default threshold grows up to 32 MB as large blocks are freed, which leaves a 2,048-token backward's tensors in
# the heap: its peak resident size then measured 1.9 GB instead of 0.35 GB.
MMAP_THRESHOLD = 1024 * 1024
_M_MMAP_THRESHOLD = -3
IDLE_TRIM_SECONDS = 0.5  # no admitted work for this long: hand freed memory back (gc + malloc_trim)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes of work on one model, from its config (`from_model`)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    logit_chunk: int  # positions whose logits exist at once (`logprobs.LOGIT_CHUNK`)

    @classmethod
    def from_model(cls, model, logit_chunk: int) -> MemoryModel:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
        dtype = next(model.parameters()).dtype
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(getattr(config, "intermediate_size", 0) or 4 * hidden),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", 0) or heads),
            head_dim=head_dim,
            vocab=int(model.get_output_embeddings().weight.shape[0]),
            dtype_bytes=torch.finfo(dtype).bits // 8,
            logit_chunk=logit_chunk,
        )

    @property
    def layer_token_bytes(self) -> int:
        """What autograd keeps of one layer for one token (measured 4.6 I + 5.4 H + 2 (heads + kv) d, rounded up)."""
        values = 5 * self.intermediate + 6 * self.hidden + 2 * (self.heads + self.kv_heads) * self.head_dim
        return values * self.dtype_bytes

    @property
    def kv_token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def logits_bytes(self) -> int:
        """One chunk of fp32 logits and the few vocabulary-wide tensors made from it."""
        return 4 * self.logit_chunk * self.vocab * 4

    def chunk_bytes(self, tokens: int, backward: bool, recomputed: bool) -> int:
        """A forward (and backward) over `tokens` padded tokens at once."""
        if not backward:  # nothing kept: one layer's tensors at a time, and the KV cache of a shared prefix
            return tokens * (2 * self.layer_token_bytes + self.kv_token_bytes) + self.logits_bytes
        if recomputed:  # each layer's input kept, one layer recomputed at a time (twice: forward and its gradient)
            return tokens * (self.layers * self.hidden * self.dtype_bytes + 2 * self.layer_token_bytes) + (
                2 * self.logits_bytes
            )
        return tokens * (self.layers + 1) * self.layer_token_bytes + 2 * self.logits_bytes

    def sample_bytes(self, prompt: int, num_samples: int, max_tokens: int) -> int:
        """A sample request: its rows' KV cache at full length (twice: a batch join concatenates copies), its
        prompt's prefill (one layer at a time, logits of the last position only), and the per-step
        vocabulary-wide tensors of its rows (logits, the sampling distribution)."""
        cache = 2 * self.kv_token_bytes * num_samples * (prompt + max_tokens)
        prefill = prompt * (2 * self.layer_token_bytes + self.kv_token_bytes)
        return cache + prefill + 8 * num_samples * self.vocab * 4

    def prompt_logprobs_bytes(self, prompt: int, topk: int) -> int:
        return self.chunk_bytes(prompt, backward=False, recomputed=False) + prompt * max(topk, 1) * 64


def available_memory() -> int | None:
    """MemAvailable of this machine (Linux), in bytes; None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_budget() -> int:
    available = available_memory()
    if available is None:
        return 8 * GIB
    return max(GIB // 2, int(available * DEFAULT_BUDGET_FRACTION))


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


class MemoryGate:
    """Working memory admitted against `budget` bytes (see the module's docstring)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.used = 0
        self.peak = 0  # most bytes admitted at once (tests, logs)
        self._cv = threading.Condition()
        self._queue: list[object] = []  # tickets of blocked `acquire` calls, oldest first
        self._trim: threading.Timer | None = None

    def refuse_beyond(self, size: int, what: str) -> None:
        """413 when `size` bytes could never be admitted."""
        if size > self.budget:
            raise ApiError(
                413,
                "exceeds_memory_budget",
                f"{what} needs about {gib(size)} of working memory; this server admits at most {gib(self.budget)} "
                "at once (ServerConfig.memory_budget_bytes, pytrio-serve --memory-budget-gb); send shorter or fewer "
                "items per request",
            )

    def try_acquire(self, size: int) -> bool:
        """Admit `size` now if it fits and nobody waits before it."""
        with self._cv:
            if self._queue or self.used + size > self.budget:
                return False
            self._take(size)
            return True

    def acquire(self, size: int) -> None:
        """Admit `size`, waiting in order until it fits (`refuse_beyond` first: a size above the budget waits for
        nothing but the budget)."""
        size = min(size, self.budget)
        ticket = object()
        with self._cv:
            self._queue.append(ticket)
            try:
                self._cv.wait_for(lambda: self._queue[0] is ticket and self.used + size <= self.budget)
                self._take(size)
            finally:
                self._queue.remove(ticket)
                self._cv.notify_all()

    def release(self, size: int) -> None:
        with self._cv:
            self.used -= min(size, self.budget)
            self._cv.notify_all()
            if self.used == 0 and self._trim is None:  # a burst may have ended: trim once it stayed idle a moment
                self._trim = threading.Timer(IDLE_TRIM_SECONDS, self._trim_if_idle)
                self._trim.daemon = True
                self._trim.start()

    def _trim_if_idle(self) -> None:
        with self._cv:
            self._trim = None
            if self.used:
                return
        release_freed_memory()  # what the allocator kept of the burst goes back to the system

    @contextmanager
    def reserve(self, size: int):
        self.acquire(size)
        try:
            yield
        finally:
            self.release(size)

    def _take(self, size: int) -> None:
        self.used += size
        self.peak = max(self.peak, self.used)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


_LIBC = _libc()


def tune_allocator() -> None:
    """glibc: large blocks mmapped (`MMAP_THRESHOLD`), so freed activations leave the process at once."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Free unreachable Python objects, then hand glibc's free heap pages back to the system (`malloc_trim`)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
