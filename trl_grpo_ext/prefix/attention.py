"""Segment attention: a packed forward's attention run by the model's own kernel, with no dense T x T mask.

A packed stream is a sequence of *segments* (the level-1 prefix, each prompt's rest, each row's own tokens; see
`layout`). A segment's tokens attend to at most two ancestor key ranges (the prefix, its prompt's rest) and to
their own segment's keys causally: the attention each token has in the plain forward (Prefix Grouper, arXiv
2506.05433: the shared part is computed once, each row attends [shared keys; its own keys] with a lower-right
causal mask). Keys live in a *key space*: stored context slots first (a `PromptContext`'s keys/values, when the
shared parts were encoded by an earlier forward), then the stream's own tokens.

`SegmentAttention` (passed to the model as the ``prefix_attention`` keyword argument, which transformers hands
down to every attention call as it does its own flash-attention keywords) carries that layout; `install` wraps
the registered ``sdpa``, ``flash_attention_2/3`` and ``flex_attention`` functions of transformers'
`AttentionInterface` so that a call carrying it runs:

- ``sdpa``: the segments grouped in a few buckets (`plan_buckets`), each one ``scaled_dot_product_attention``
  call over gathered queries/keys: segments with equal ancestor lengths as a square ``is_causal`` problem (keys
  ``[ancestors; own]``, the ancestors' query slots filled with throw-away queries, so sdpa's flash kernels and
  their causal block skipping run), others with a small ``(segments, 1, own, ancestors + own)`` bool mask;
- ``flash_attention_2`` / ``_3``: one varlen call through transformers' own flash path (``cu_seq_lens_q/k``):
  queries are the stream, keys each segment's ``[ancestors; own]`` gathered, causal bottom-right aligned;
- ``flex_attention``: one call over the whole key space with a block-sparse ``BlockMask`` built from the same
  ranges.

A call without ``prefix_attention`` goes to the wrapped function unchanged, except an ``sdpa`` decode step on the CPU
in bf16, which runs as one packed call (`trl_grpo_ext.cpu.decode_attention`; the generation paths call `install` for
it). ``eager`` is not wrapped: it keeps a dense 4D mask (`layout.dense_visibility`).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from trl_grpo_ext.cpu.decode_attention import packed_decode_attention

# Implementations whose registered function `install` wraps, by how the layout runs under them.
SDPA_ATTENTION = ("sdpa",)
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")
FLEX_ATTENTION = ("flex_attention",)
FUSED_ATTENTION = SDPA_ATTENTION + FLASH_ATTENTION + FLEX_ATTENTION

# Fixed cost of one more sdpa call per layer (gathers, launch), in attention pairs, where the caller doesn't say
# (`cost.ModelCost.call_overhead_pairs`): keeps `plan_buckets` from splitting segments into many small calls to
# save a few padded pairs.
BUCKET_OVERHEAD_PAIRS = 32768


def take(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``tensor`` indexed by `index` along `dim` (``tensor[:, index]`` for dim 1), through ``index_select``. The same
    values; the difference is the backward, where a slot read several times (a shared key, by every segment that
    sees it) sums its gradients: ``index_select``'s backward adds them in index order whatever torch's thread count,
    while advanced indexing's (``index_put_`` with accumulate) splits them over the threads on the CPU, so its
    rounding, and a run's gradients in the last bits, would follow the thread count."""
    return tensor.index_select(dim, index.reshape(-1)).unflatten(dim, index.shape)


def kind_of(attn_implementation: str | None) -> str | None:
    """``"sdpa"``, ``"flash"``, ``"flex"`` or ``"eager"`` (dense mask) for an attention implementation, else None."""
    if attn_implementation in SDPA_ATTENTION:
        return "sdpa"
    if attn_implementation in FLASH_ATTENTION:
        return "flash"
    if attn_implementation in FLEX_ATTENTION:
        return "flex"
    if attn_implementation == "eager":
        return "eager"
    return None


# ------------------------------------------------------------------------------------------------- sdpa buckets
@dataclass(frozen=True)
class Bucket:
    """Segments run by one sdpa call: ``causal`` (all with ``front`` ancestor keys: a square causal problem of side
    ``front + width``) or masked (ancestors left-padded to ``front``, then ``width`` own slots)."""

    segments: tuple[int, ...]
    front: int
    width: int
    causal: bool

    @property
    def pairs(self) -> int:
        side = self.front + self.width
        return len(self.segments) * (side * (side + 1) // 2 if self.causal else self.width * side)


def _partition(order: list[int], own: list[int], anc: list[int], causal: bool, overhead: int) -> list[Bucket]:
    """Split `order` (segments sorted by own length, longest first) into consecutive buckets of least total cost
    (pairs plus `overhead` per bucket); O(n^2) over segments, not tokens."""
    n = len(order)
    best = [0] + [None] * n  # best[i]: cost of order[:i]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        front = 0
        for start in range(end - 1, -1, -1):
            front = max(front, anc[order[start]])
            width = own[order[start]]  # longest of order[start:end]
            side = front + width
            count = end - start
            pairs = count * (side * (side + 1) // 2 if causal else width * side)
            cost = best[start] + pairs + overhead
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    buckets, end = [], n
    while end:
        start = cut[end]
        members = order[start:end]
        front = max(anc[s] for s in members)
        buckets.append(Bucket(tuple(members), front, own[members[0]], causal))
        end = start
    return buckets[::-1]


def plan_buckets(anc: list[int], own: list[int], holes: bool, overhead: int = BUCKET_OVERHEAD_PAIRS) -> list[Bucket]:
    """Group segments (ancestor key count, own token count) into sdpa calls of least cost.

    Candidates, the cheapest wins: every segment masked (one partition by own length); each group of equal
    ancestor length causal (partitioned by own length); each group causal where that beats masking it, the other
    segments pooled masked. With `holes` (keys inside a segment that no one attends to) only masks can express it.
    `overhead`: the cost of one more call, in pairs.
    """

    def cost(buckets):
        return sum(b.pairs + overhead for b in buckets)

    segments = [s for s in range(len(own)) if own[s] > 0]
    by_length = sorted(segments, key=lambda s: (-own[s], s))
    candidates = [_partition(by_length, own, anc, False, overhead)]
    if not holes:
        classes: dict[int, list[int]] = {}
        for s in by_length:
            classes.setdefault(anc[s], []).append(s)
        causal = {a: _partition(members, own, anc, True, overhead) for a, members in classes.items()}
        candidates.append([b for buckets in causal.values() for b in buckets])
        better = [
            a
            for a, members in classes.items()
            if cost(causal[a]) < cost(_partition(members, own, anc, False, overhead))
        ]
        pooled = [s for s in by_length if anc[s] not in better]
        candidates.append([b for a in better for b in causal[a]] + _partition(pooled, own, anc, False, overhead))
    return min(candidates, key=cost)


# ------------------------------------------------------------------------------------------------- the layout
@dataclass(eq=False)
class SegmentAttention:
    """The attention layout of one packed forward, for every layer (``prefix_attention=`` keyword argument).

    Attributes:
        ranges_host: per segment the (start, length) in key space of its prefix keys, its prompt rest's keys and
            its own keys (zero length where it has none); `ranges` is the same on `device`, built on first use.
        query_start: per segment, where its own tokens start in the stream (queries). Segments lie in stream
            order, back to back.
        stream_length: tokens in the stream (the forward's sequence; batch 1).
        kind: ``"sdpa"``, ``"flash"`` or ``"flex"``.
        context_length: stored context slots at the start of key space (`context_keys`/`context_values`: per
            layer (heads, slots, head_dim), read by every layer's call; ``None`` without a context).
        holes: some key inside a segment is not attended to (completion padding before a row's end);
            `key_valid` (context + stream,) bool then says which, and sdpa runs masked buckets only.
        call_overhead: one more sdpa call per layer, in attention pairs (bucket planning).
    """

    ranges_host: tuple[tuple[tuple[int, int], ...], ...]
    query_start: tuple[int, ...]
    stream_length: int
    kind: str
    device: torch.device
    context_length: int = 0
    holes: bool = False
    call_overhead: int = BUCKET_OVERHEAD_PAIRS
    context_keys: list[torch.Tensor] | None = None
    context_values: list[torch.Tensor] | None = None
    key_valid: torch.Tensor | None = None
    _built: dict = field(default_factory=dict, repr=False)

    @property
    def ranges(self) -> torch.Tensor:
        if "ranges" not in self._built:
            host = torch.tensor(self.ranges_host, dtype=torch.long).reshape(-1, 3, 2)
            self._built["ranges"] = host.to(self.device)
        return self._built["ranges"]

    def segment_of_query(self) -> torch.Tensor:
        """(stream,) the segment of each stream token (segments lie in stream order, back to back)."""
        if "segment_of" not in self._built:
            own = torch.tensor(self.own_lengths(), device=self.ranges.device)
            self._built["segment_of"] = torch.repeat_interleave(
                torch.arange(len(own), device=own.device), own, output_size=self.stream_length
            )
        return self._built["segment_of"]

    def anc_lengths(self) -> list[int]:
        return [r[0][1] + r[1][1] for r in self.ranges_host]

    def own_lengths(self) -> list[int]:
        return [r[2][1] for r in self.ranges_host]

    # ------------------------------------------------------------------------------------------- cost
    def attention_pairs(self) -> int:
        """(query, key) pairs the kernel computes, for the cost model."""
        anc, own = self.anc_lengths(), self.own_lengths()
        if self.kind == "sdpa":
            return sum(b.pairs + self.call_overhead for b in self.buckets())
        return sum(o * a + o * (o + 1) // 2 for a, o in zip(anc, own, strict=True))

    def gathered_slots(self) -> int:
        """Query + key slots the kernel's inputs gather (sdpa buckets, flash keys), for the cost model."""
        if self.kind == "sdpa":
            return sum(len(b.segments) * (2 * b.front + 2 * b.width if b.causal else b.front + 2 * b.width)
                       for b in self.buckets())  # fmt: skip
        if self.kind == "flash":
            return sum(sum(x[1] for x in r) for r in self.ranges_host)
        return 0

    def buckets(self) -> list[Bucket]:
        if "buckets" not in self._built:
            self._built["buckets"] = plan_buckets(
                self.anc_lengths(), self.own_lengths(), self.holes, self.call_overhead
            )
        return self._built["buckets"]

    # ------------------------------------------------------------------------------------------- index tensors
    def _key_index(self, segments: torch.Tensor, slot: torch.Tensor, front: int):
        """Key-space index of slot `slot` (broadcast) of `segments`' key rows laid out ``[ancestors left-padded to
        front][own]``, and whether the slot holds a real key."""
        (p_start, p_len), (r_start, r_len), (o_start, o_len) = (
            bound.unbind(1) for bound in self.ranges[segments].unsqueeze(-1).unbind(1)
        )  # each (n, 1)
        a = slot - (front - (p_len + r_len))  # index within the ancestors, negative in the left padding
        own = slot - front
        index = torch.where(a < p_len, p_start + a, r_start + a - p_len)
        index = torch.where(slot < front, index, o_start + own.clamp(max=o_len - 1))
        real = ((slot < front) & (a >= 0)) | ((slot >= front) & (own < o_len))
        return torch.where(real, index, 0), real

    def _bucket_tensors(self, bucket: Bucket) -> dict:
        device = self.ranges.device
        segments = torch.tensor(bucket.segments, dtype=torch.long, device=device)
        n, front, width = len(bucket.segments), bucket.front, bucket.width
        q_start = torch.tensor([self.query_start[s] for s in bucket.segments], device=device).unsqueeze(1)
        own_len = self.ranges[segments, 2, 1].unsqueeze(1)
        side = front + width
        slot = torch.arange(side, device=device).unsqueeze(0)
        keys, real = self._key_index(segments, slot, front)
        if bucket.causal:  # queries in the ancestor slots are throw-away (their outputs are not read)
            q_offset = (slot - front).clamp(min=0)
            queries = q_start + torch.minimum(q_offset, own_len - 1)
            mask = None
        else:
            q_slot = torch.arange(width, device=device)
            queries = q_start + torch.minimum(q_slot.unsqueeze(0), own_len - 1)
            key_slot = slot.view(1, 1, side)
            visible = real.unsqueeze(1) & ((key_slot < front) | (key_slot - front <= q_slot.view(1, width, 1)))
            if self.key_valid is not None:
                visible = visible & self.key_valid[keys].unsqueeze(1)
            # a padded query still sees its row's first own key (always valid): no all-masked row, no NaN
            mask = visible.unsqueeze(1)
        return {"queries": queries.reshape(-1), "keys": keys.reshape(-1), "mask": mask, "n": n}

    def _sdpa_tensors(self) -> dict:
        if "sdpa" not in self._built:
            device = self.ranges.device
            buckets = [self._bucket_tensors(b) for b in self.buckets()]
            # where each stream token's output lies in the concatenated bucket outputs: its segment's first query
            # slot (`base`) plus its offset in the segment
            base = [0] * len(self.query_start)
            offset = 0
            for bucket in self.buckets():
                rows = bucket.front + bucket.width if bucket.causal else bucket.width
                for i, s in enumerate(bucket.segments):
                    base[s] = offset + i * rows + (bucket.front if bucket.causal else 0)
                offset += len(bucket.segments) * rows
            segment_of = self.segment_of_query()
            start = torch.tensor(self.query_start, device=device)
            tokens = torch.arange(self.stream_length, device=device)
            back = torch.tensor(base, device=device)[segment_of] + tokens - start[segment_of]
            self._built["sdpa"] = (buckets, back)
        return self._built["sdpa"]

    def _flash_tensors(self) -> dict:
        if "flash" not in self._built:
            device = self.ranges.device
            lengths = self.ranges[:, :, 1]  # (S, 3)
            total = lengths.sum(1)
            starts = self.ranges[:, :, 0]
            key_len = sum(sum(x[1] for x in r) for r in self.ranges_host)
            # each segment's keys: [prefix range][rest range][own range], concatenated over segments
            piece = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.reshape(-1),
                                            output_size=key_len)  # fmt: skip
            piece_first = torch.cumsum(lengths.reshape(-1), 0) - lengths.reshape(-1)
            keys = starts.reshape(-1)[piece] + torch.arange(key_len, device=device) - piece_first[piece]
            own = [r[2][1] for r in self.ranges_host]
            cu_q = torch.tensor([0] + own, device=device).cumsum(0).to(torch.int32)
            cu_k = torch.cat([total.new_zeros(1), total.cumsum(0)]).to(torch.int32)
            self._built["flash"] = {
                "keys": keys,
                "cu_seq_lens_q": cu_q,
                "cu_seq_lens_k": cu_k,
                "max_length_q": max(own),
                "max_length_k": max(sum(x[1] for x in r) for r in self.ranges_host),
            }
        return self._built["flash"]

    def _block_mask(self):
        if "flex" not in self._built:
            device = self.device
            from torch.nn.attention.flex_attention import create_block_mask

            context = self.context_length
            segment_of = self.segment_of_query()
            key_valid = self.key_valid
            # per query token, its segment's key bounds: flex compiles mask_mod pointwise (no in-place ops, no
            # gather of a gather)
            starts = self.ranges[:, :, 0][segment_of]
            ends = (self.ranges[:, :, 0] + self.ranges[:, :, 1])[segment_of]
            p_start, r_start, o_start = (x.contiguous() for x in starts.unbind(1))
            p_end, r_end = (x.contiguous() for x in ends.unbind(1)[:2])
            own_key = torch.arange(context, context + self.stream_length, device=device)  # each query's own key

            def mask_mod(b, h, q, k):
                seen = ((k >= p_start[q]) & (k < p_end[q])) | ((k >= r_start[q]) & (k < r_end[q]))
                seen = seen | ((k >= o_start[q]) & (k <= own_key[q]))
                return seen if key_valid is None else seen & key_valid[k]

            self._built["flex"] = create_block_mask(
                mask_mod, B=None, H=None, Q_LEN=self.stream_length, KV_LEN=context + self.stream_length,
                device=device, _compile=device.type == "cuda",
            )  # fmt: skip
        return self._built["flex"]

    def prepare(self) -> SegmentAttention:
        """Build the index tensors (or block mask) its kernel reads, once, before the forward's first layer."""
        if self.kind == "sdpa":
            self._sdpa_tensors()
        elif self.kind == "flash":
            self._flash_tensors()
        else:
            self._block_mask()
        return self

    # ------------------------------------------------------------------------------------------- run
    def key_source(self, module, key: torch.Tensor, value: torch.Tensor):
        """(heads, context + stream, dim) keys and values of the layer: stored context slots then the stream."""
        key, value = key[0], value[0]
        if self.context_keys is None:
            return key, value
        layer = module.layer_idx
        return torch.cat([self.context_keys[layer], key], dim=1), torch.cat([self.context_values[layer], value], 1)

    def __call__(self, original, module, query, key, value, dropout=0.0, scaling=None):
        if query.size(0) != 1 or query.size(2) != self.stream_length:
            raise ValueError(f"prefix_attention: a stream of {self.stream_length} tokens, got {tuple(query.shape)}")
        keys, values = self.key_source(module, key, value)
        if self.kind == "flash":
            t = self._flash_tensors()
            k = take(keys, 1, t["keys"]).unsqueeze(0)
            v = take(values, 1, t["keys"]).unsqueeze(0)
            varlen = {name: t[name] for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
            return original(module, query, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **varlen)
        if self.kind == "flex":
            mask = self._block_mask()
            return original(module, query, keys.unsqueeze(0), values.unsqueeze(0), mask, scaling=scaling,
                            dropout=dropout)  # fmt: skip
        buckets, back = self._sdpa_tensors()
        q_all = query[0]
        outputs = []
        for t in buckets:
            n = t["n"]
            q = take(q_all, 1, t["queries"]).unflatten(1, (n, -1)).transpose(0, 1)
            k = take(keys, 1, t["keys"]).unflatten(1, (n, -1)).transpose(0, 1)
            v = take(values, 1, t["keys"]).unflatten(1, (n, -1)).transpose(0, 1)
            out, _ = original(
                module, q, k, v, t["mask"], dropout=dropout, scaling=scaling, is_causal=t["mask"] is None
            )
            outputs.append(out.flatten(0, 1))  # (n * query slots, heads, dim)
        return take(torch.cat(outputs), 0, back).unsqueeze(0), None


# ------------------------------------------------------------------------------------------------- dispatch
def _dispatch(
    original, module, query, key, value, attention_mask, *args, prefix_attention=None, attention_name="", **kwargs
):
    if prefix_attention is None:
        # a CPU bf16 decode step: one packed call (trl_grpo_ext.cpu.decode_attention)
        if attention_name == "sdpa" and not args:
            packed = packed_decode_attention(module, query, key, value, attention_mask, **kwargs)
            if packed is not None:
                return packed
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    kwargs.pop("position_ids", None)  # the layout, not positions, says which keys each query sees
    dropout = kwargs.pop("dropout", args[0] if args else 0.0)
    scaling = kwargs.pop("scaling", args[1] if len(args) > 1 else None)
    return prefix_attention(original, module, query, key, value, dropout=dropout, scaling=scaling)


_INSTALL_LOCK = threading.Lock()
_WRAPPED: dict[str, object] = {}


def install() -> None:
    """Wrap the registered fused attention functions (idempotent): a call with ``prefix_attention`` runs the
    segment layout, an ``sdpa`` decode step on the CPU in bf16 one packed call (`packed_decode_attention`), any other
    call the registered function unchanged."""
    from transformers import AttentionInterface

    with _INSTALL_LOCK:
        mapping = AttentionInterface._global_mapping
        for name in FUSED_ATTENTION:
            current = mapping.get(name)
            if current is None or current is _WRAPPED.get(name):
                continue
            wrapper = functools.partial(_dispatch, current, attention_name=name)
            _WRAPPED[name] = wrapper
            AttentionInterface.register(name, wrapper)


def placeholder_mask(device) -> torch.Tensor:
    """The ``attention_mask`` of a segment-attention forward: 4D, so transformers builds no mask of its own, and
    empty, so a kernel that did not get the layout fails on its shape instead of attending everywhere."""
    return torch.ones((1, 1, 0, 0), dtype=torch.bool, device=device)
