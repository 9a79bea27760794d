"""bf16 autocast training without a bf16 copy of every weight held from the forward pass into the backward pass.

Under autocast a matmul casts its fp32 weight to bf16 and autograd saves that copy (the input's gradient reads
it); autocast also keeps every copy it made in a cache until the autocast region ends. So a training forward ends
with a bf16 copy of the whole model alive beside the activations: 0.27 GB for the embedded SmolLM2-135M, the reason
a bf16 step peaked above an fp32 one (docs/precision.md).

`recast_weights()` saves a reference to the fp32 parameter in place of its bf16 copy (or of the copy's transpose,
what ``linear`` saves) and casts the parameter again when the backward pass reads it, with autocast's cache off so
that no copy outlives the op that made it. The weights do not change between a forward and its backward, and the
cast is the same, so the gradients are the same to the bit; the cost is one cast per weight in the backward pass.

Only copies autograd can trace to a trainable fp32 parameter are replaced (its ``ToCopyBackward0`` node leads to the
parameter's ``AccumulateGrad``); anything else is saved as autograd saves it. Frozen weights (LoRA's base layers)
are not cached by autocast and cannot be traced from their copy: they are saved as before.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _parameter_of_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``(parameter, transposed)`` where `tensor` is autocast's half-precision copy of a trainable fp32 parameter
    (``transposed``: its ``.t()``, what ``linear`` saves), else None."""
    if tensor.dtype not in _HALF_DTYPES:
        return None
    node = tensor.grad_fn
    transposed = node is not None and node.name() == "TBackward0"
    if transposed:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return None
    source = node.next_functions[0][0]
    parameter = getattr(source, "variable", None)  # AccumulateGrad nodes hold their leaf
    if parameter is None or parameter.dtype != torch.float32:
        return None
    return parameter, transposed


class _Recast:
    """What a saved weight copy becomes: the parameter it was cast from, the dtype, and whether it was transposed."""

    __slots__ = ("parameter", "dtype", "transposed")

    def __init__(self, parameter: torch.Tensor, dtype: torch.dtype, transposed: bool):
        self.parameter, self.dtype, self.transposed = parameter, dtype, transposed

    def tensor(self) -> torch.Tensor:
        copy = self.parameter.detach().to(self.dtype)
        return copy.t() if self.transposed else copy


def _pack(tensor: torch.Tensor):
    found = _parameter_of_copy(tensor)
    if found is None:
        # detached: a tensor an op saves of its own output holds that op's node as its grad_fn, and the node would
        # hold it back through this hook: a cycle through C++ that Python's collector cannot free (a graph a step)
        return tensor.detach()
    return _Recast(found[0], tensor.dtype, found[1])


def _unpack(packed):
    return packed.tensor() if isinstance(packed, _Recast) else packed


@contextlib.contextmanager
def recast_weights():
    """Inside: autocast's weight cache off and the half-precision copies of trainable fp32 parameters that autograd
    saves replaced by the parameters, cast again in the backward pass (module docstring). Enter it before the
    autocast region starts: ``torch.autocast`` reads whether its cache is on when it is built."""
    cache_was_on = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        torch.set_autocast_cache_enabled(cache_was_on)
