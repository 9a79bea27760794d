"""Drawing one token per row on the CPU: ``torch.multinomial(probs, 1)``'s own algorithm, vectorised.

For one sample, torch (ATen's ``multinomial``, torch 2.13) takes ``argmax(probs / q)`` with ``q`` a tensor of
exponential variates filled by ``exponential_`` -- on the CPU an element-by-element loop that turns each uniform
double of the generator's stream into ``-log1p(-u)``. At 24 rows of a 49,152-token vocabulary that loop is 18-19 ms
of every decode step on 2 cores (a quarter of the embedded recipe's sampling). `draw_tokens` draws the same uniform
doubles in the same order (``torch.rand``), applies the same transform vectorised, and takes the same argmax: the
same tokens, the generator left in the same state, in 5-6 ms (`bench/sampler.py`; tests/test_token_draws.py checks
the identity).

transformers' ``generate`` draws each sampled token with ``torch.multinomial(probs, num_samples=1)`` and has no hook
for it: `fast_token_draws` routes those calls, in the current thread and for the duration of a ``with`` block, to
`draw_tokens`. Any other call (CUDA tensors, several samples, an ``out=``, another dtype, an invalid distribution,
which torch's own check then reports) goes to torch's function unchanged, and so does every call where a torch
version draws otherwise (`matches_torch`, checked once per process).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

# dtypes whose exponential variates torch computes from one uniform double each (the identity above)
DRAWN_DTYPES = (torch.float32, torch.float64)

_torch_multinomial = torch.multinomial
_state = threading.local()
_install_lock = threading.Lock()


def drawable(probs: torch.Tensor, num_samples: int) -> bool:
    """Whether `draw_tokens` gives ``torch.multinomial(probs, num_samples)``'s result: one sample from each row of a
    2-D CPU tensor of float32/float64 weights."""
    return num_samples == 1 and probs.dim() == 2 and probs.device.type == "cpu" and probs.dtype in DRAWN_DTYPES


def valid_distribution(probs: torch.Tensor) -> bool:
    """Rows torch would accept: no negative, infinite or NaN weight, and a positive sum in each row."""
    sums = probs.sum(dim=-1)
    return bool(probs.amin() >= 0) and bool(torch.isfinite(sums).all()) and bool((sums > 0).all())


def draw_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)`` for `probs` where `drawable`: the same (rows, 1) indices
    from the same random numbers (module docstring)."""
    # exponential_(1) on the CPU: q = -log1p(-u), u a uniform double, computed in double and stored in probs' dtype
    q = torch.rand(probs.shape, dtype=torch.float64, generator=generator).neg_().log1p_().neg_().to(probs.dtype)
    return torch.argmax(probs / q, dim=-1, keepdim=True)


@functools.cache
def matches_torch() -> bool:
    """Whether this torch's CPU ``multinomial`` draws what `draw_tokens` draws, and leaves its generator where
    `draw_tokens` leaves it (checked once per process on random weights: the identity is torch's implementation,
    checked on torch 2.13, not its documented behaviour)."""
    probs = torch.rand(4, 1000, generator=torch.Generator().manual_seed(0))
    for seed in range(4):
        theirs_gen, ours_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        theirs = _torch_multinomial(probs, 1, generator=theirs_gen)
        if not torch.equal(theirs, draw_tokens(probs, ours_gen)):
            return False
        if not torch.equal(theirs_gen.get_state(), ours_gen.get_state()):
            return False
    return True


def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
    """``torch.multinomial`` with its result, by `draw_tokens` where that gives it (module docstring)."""
    if out is None and drawable(input, num_samples) and valid_distribution(input) and matches_torch():
        return draw_tokens(input, generator)  # one sample: with or without replacement alike
    return _torch_multinomial(input, num_samples, replacement, generator=generator, out=out)


def _multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
    if getattr(_state, "depth", 0):
        generator = generator if generator is not None else getattr(_state, "generator", None)
        return multinomial(input, num_samples, replacement, generator=generator, out=out)
    return _torch_multinomial(input, num_samples, replacement, generator=generator, out=out)


@contextlib.contextmanager
def fast_token_draws(generator: torch.Generator | None = None):
    """``torch.multinomial`` calls of this thread inside the block drawn by `draw_tokens` where it gives their result
    (module docstring). Nests; other threads keep torch's function.

    `generator`: the random stream of the block's draws that name none (transformers' ``generate`` names none), in
    place of torch's default one: a sampler in its own thread then draws from its own seeded stream, whatever the
    other threads draw from the default one meanwhile."""
    with _install_lock:  # installed once per process; outside a block it passes every call to torch's
        if torch.multinomial is not _multinomial:
            torch.multinomial = _multinomial
    outer = getattr(_state, "generator", None)
    _state.depth = getattr(_state, "depth", 0) + 1
    _state.generator = generator if generator is not None else outer
    try:
        yield
    finally:
        _state.depth -= 1
        _state.generator = outer
