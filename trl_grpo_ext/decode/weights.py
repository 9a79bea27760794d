"""A decoder's linear weights prepacked for oneDNN's small-batch kernels, fused where one call can do two or three.

At a decode step every projection multiplies a few rows (one token per sequence) by a large weight. torch's default
``linear`` (MKL's sgemm on x86) repacks the weight into its panel layout at every call: for the embedded model's
output layer (576 x 49,152 fp32, 113 MB) that is a read, a write and a read again of the whole matrix per token,
34-50 ms at 12 rows on a 2-core AMD EPYC against 11-12 ms with the weight packed once in oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``: the kernels torch's inductor calls for frozen
linears); the per-layer projections gain 1.2-2x (`bench/decode.py`). The results differ from ``linear``'s by the
rounding of another summation order (largest difference ~4e-6 on unit-scale inputs).

`PackedWeights` packs once per set of weights: it is kept beside the model and rebuilt when any weight changed (an
optimizer step or a weight load bumps the tensor's version counter), so a sampler that keeps its weights for many
batches (evaluation, an asynchronous sampler's version) packs once, and an on-policy trainer once per generation.
The packed copy holds the weights a second time (the model's own stay where they are for training) until the model
is freed or its weights change.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

_lock = threading.Lock()
# model -> its packed copy; beside the model rather than on it, so copying or pickling a model never meets one
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# each decoder layer's linear projections, by attribute: the attention's, then the MLP's
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def packed_kernels_available() -> bool:
    """oneDNN's packed fp32 linear is in this torch build (x86 and aarch64 CPU builds have it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with `weight` from `_pack` (any number of rows: the packing's row count is a hint)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor):
    """``residual + (x @ W.T + b)`` in one call (oneDNN's sum post-op)."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")


@dataclasses.dataclass
class PackedLayer:
    """One decoder layer's projections: q, k, v as one call (their outputs side by side), gate and up as one."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [b.detach() if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, linears, strict=True)]
    )


def _bias(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


@dataclasses.dataclass
class PackedWeights:
    """Every linear weight of a Llama-layout decoder packed for `rows`-row calls (module docstring)."""

    layers: list[PackedLayer]
    head: torch.Tensor
    head_bias: torch.Tensor | None
    key: tuple

    @staticmethod
    def version_key(model) -> tuple:
        """Which weights these are: each linear weight's storage and version counter (bumped by every in-place
        write: an optimizer step, ``load_state_dict``, ``copy_``)."""
        return tuple((m.weight.data_ptr(), m.weight._version) for m in _linears_of(model))

    @classmethod
    def build(cls, model, rows: int) -> PackedWeights:
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            layers.append(
                PackedLayer(
                    qkv=_pack(qkv, rows),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    o=_pack(attn.o_proj.weight, rows),
                    o_bias=_bias(attn.o_proj),
                    gate_up=_pack(gate_up, rows),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down=_pack(mlp.down_proj.weight, rows),
                    down_bias=_bias(mlp.down_proj),
                )
            )
        head = model.lm_head
        return cls(layers, _pack(head.weight, rows), _bias(head), (rows, cls.version_key(model)))


def layer_linears(layer) -> list:
    """A decoder layer's projections (`ATTENTION_PROJECTIONS` then `MLP_PROJECTIONS`; None where one is missing)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return [getattr(attn, n, None) for n in ATTENTION_PROJECTIONS] + [getattr(mlp, n, None) for n in MLP_PROJECTIONS]


def _linears_of(model):
    for layer in model.model.layers:
        yield from layer_linears(layer)
    yield model.lm_head


def packed_weights(model, rows: int) -> PackedWeights:
    """`model`'s weights packed for `rows` rows: the copy kept beside the model if its row count and weights have not
    changed since, else a new one (which replaces it: one packed copy per model)."""
    key = (rows, PackedWeights.version_key(model))
    with _lock:  # a trainer and its asynchronous sampler hold different models; one model, one packing at a time
        cached = _packed.get(model)
        if cached is not None and cached.key == key:
            return cached
        _packed.pop(model, None)  # the old copy freed before the new one is built
        packed = _packed[model] = PackedWeights.build(model, rows)
        return packed


def release_packed(model) -> None:
    """Drop `model`'s packed copy, if it has one: for a model whose weights are about to change (a trainer's, after
    its generation) or that is done sampling (an evaluation's borrowed model), a copy kept would only hold memory."""
    with _lock:
        _packed.pop(model, None)
