"""The cost model that picks, per micro-batch, the packed layout or TRL's padded one (`packed_is_cheaper`); the local
PyTRIO server asks it the same about its right-padded batch (`packing.packed_beats_padded`), whose rows of
``width`` slots cost what TRL's do.

Both layouts run the same kernels, so their forward FLOPs compare them (backward costs about twice the forward in
both): tokens through the linear layers, positions through the LM head where TRL's fused head scores every
position (off CUDA), and (query, key) pairs the attention kernel computes, as each kernel computes them:

- TRL's padded rows: ``rows x width`` tokens; pairs ``rows x width^2`` under sdpa with any padding (transformers
  then passes a mask, so no causal block skipping) or eager, ``rows x width^2 / 2`` under sdpa without padding
  and flex-attention (causal), the rows' real lengths squared / 2 under flash-attention (it unpads);
- packed: its slots; pairs as `attention.SegmentAttention.attention_pairs` counts them (sdpa buckets with their
  padding and a fixed per-call overhead; per segment ancestors x own + own^2 / 2 under flash/flex), ``bins x T^2``
  under eager, plus the gathers that copy queries/keys/values into buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

# The packed layout must be this much cheaper by the model to be used: what the model leaves out (gathers into
# buckets and back, the extra attention calls, index tensors; kernel efficiency at other shapes) must not make a
# near tie slower than TRL's own code. Measured: a predicted 0.94 ran at 0.95-1.04 of TRL's time on CPU.
MARGIN = 0.9
# FLOP-equivalents per element a gather copies (memory-bound, against compute-bound matmuls).
GATHER_FLOPS = 16
# FLOP-equivalents of one more attention call per layer (an sdpa bucket: its gathers, launch, Python): about
# 100 us at a CPU core's ~50 GFLOP/s (forward and backward of a few small ops), 20 us at a GPU's ~250 TFLOP/s.
CALL_OVERHEAD_FLOPS = {"cpu": 5e6, "cuda": 5e9}


@dataclass(frozen=True)
class ModelCost:
    """Forward FLOPs of `model` per token (linear layers), per LM-head position and per attention pair; and the
    per-token elements of queries + keys + values over all layers (for gathers)."""

    token: float
    head: float
    pair: float
    qkv: float
    layers: int

    @classmethod
    def of(cls, config) -> ModelCost:
        hidden = config.hidden_size
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = getattr(config, "intermediate_size", None) or 4 * hidden
        projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
        return cls(
            token=2.0 * layers * projections,
            head=2.0 * hidden * config.vocab_size,
            pair=4.0 * layers * heads * head_dim,
            qkv=float(layers * (heads + 2 * kv_heads) * head_dim),
            layers=layers,
        )

    def call_overhead_pairs(self, device) -> int:
        """One more attention call per layer, in attention pairs (for `attention.plan_buckets`)."""
        flops = CALL_OVERHEAD_FLOPS.get(getattr(device, "type", str(device)), CALL_OVERHEAD_FLOPS["cuda"])
        return int(flops * self.layers / self.pair)


def padded_pairs(kind: str, lengths: list[int], width: int, padded: bool) -> int:
    """Attention pairs of TRL's padded batch: rows of `width` slots, `lengths` real tokens each."""
    rows = len(lengths)
    if kind == "flash":
        return sum(n * (n + 1) // 2 for n in lengths)
    if kind == "flex" or (kind == "sdpa" and not padded):
        return rows * width * (width + 1) // 2
    return rows * width * width


def layout_cost(cost: ModelCost, tokens: int, pairs: int, gathered: int, every_position_scored: bool) -> float:
    """Forward FLOPs of a layout: `tokens` slots, `pairs` attention pairs, `gathered` gathered token slots."""
    head = cost.head * tokens if every_position_scored else 0.0
    return cost.token * tokens + head + cost.pair * pairs + GATHER_FLOPS * cost.qkv * gathered


def packed_is_cheaper(packed: float, padded: float) -> bool:
    return packed <= MARGIN * padded
