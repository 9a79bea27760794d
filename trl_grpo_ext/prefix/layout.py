"""Packed streams: segments of rows and shared prompt parts laid out for one forward, built with tensor ops.

A *segment* is a run of tokens that attend to each other causally and to at most two ancestor key ranges: the
level-1 prefix (ancestors: none), a prompt's rest (the prefix), a row's last prompt token and completion (the
prefix and its prompt's rest). `place` lays segments out on the host (sizes only: the cost model reads them
before anything is built); `build_stream` then gathers every segment's tokens from source tensors (TRL's padded
rows) in one indexing op per field, so the host work is per segment, never per token.

Two layouts of the same segments:

- *concatenated* (batch 1, no padding at all): every segment back to back; attention runs through
  `attention.SegmentAttention` (sdpa, flash-attention, flex-attention);
- *binned* (batch = bins, right-padded to the longest bin): for ``eager``, whose only way to express the layout
  is a dense mask (`dense_visibility`) that costs T^2 per bin; bins bound T.

Key space: where the keys a segment reads lie. Stored context slots come first (``context_length`` of them), the
stream's own tokens after; in the binned layout each bin is its own key space.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Binned (eager) layout: most tokens per bin unless one row needs more. Attention over a bin costs T^2 there.
DEFAULT_MAX_PACKED_TOKENS = 4096


@dataclass(frozen=True)
class SegmentSpec:
    """One segment: tokens ``source[row, col : col + length]`` at positions ``position...``, in bin `bin`.

    ``scored``: a row segment, whose tokens after the first (its last prompt token) are completion tokens scored
    by the label of their slot. ``prefix``/``rest``: index (in the spec list) of the in-stream segment it attends
    to, or a ``(start, length)`` range of context slots, or ``None``.
    """

    row: int
    col: int
    length: int
    position: int
    bin: int
    scored: bool = False
    prefix: int | tuple[int, int] | None = None
    rest: int | tuple[int, int] | None = None


@dataclass
class Placement:
    """Where `specs` (bin-major order) lie in a stream, decided on the host before any tensor is built.

    ``rows`` x ``length``: the stream's shape (one row concatenated, one per bin binned). ``starts[s]``: where
    segment s's tokens start in its stream row; ``bins[s]``: its bin. ``ranges_host[s]``: the (start, length) in
    key space of its prefix keys, its prompt rest's keys and its own keys. Key space: `context_length` context
    slots (a `PromptContext`'s, or in the binned layout the stored slots gathered for each bin), then the row.
    """

    specs: list[SegmentSpec]
    binned: bool
    context_length: int
    starts: tuple[int, ...]
    bins: tuple[int, ...]
    rows: int
    length: int
    ranges_host: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def tokens(self) -> int:
        """Slots the forward runs (bin padding included)."""
        return self.rows * self.length

    def anc_lengths(self) -> list[int]:
        return [r[0][1] + r[1][1] for r in self.ranges_host]

    def own_lengths(self) -> list[int]:
        return [r[2][1] for r in self.ranges_host]


def place(specs: list[SegmentSpec], binned: bool, context_length: int = 0) -> Placement:
    """Lay `specs` out: back to back in one row, or binned (one row per ``spec.bin``)."""
    n_bins = max(s.bin for s in specs) + 1 if specs else 1
    starts, fill = [], [0] * n_bins
    for s in specs:
        b = s.bin if binned else 0
        starts.append(fill[b])
        fill[b] += s.length

    def key_range(ref):
        if ref is None:
            return (0, 0)
        if isinstance(ref, tuple):
            return ref
        return (starts[ref] + context_length, specs[ref].length)

    ranges = tuple(
        (key_range(s.prefix), key_range(s.rest), (starts[i] + context_length, s.length)) for i, s in enumerate(specs)
    )
    return Placement(
        specs=specs,
        binned=binned,
        context_length=context_length,
        starts=tuple(starts),
        bins=tuple(s.bin for s in specs),
        rows=n_bins if binned else 1,
        length=max(fill),
        ranges_host=ranges,
    )


@dataclass
class Stream:
    """The tensors of a `Placement` (``rows`` x ``length``): ``input_ids``, ``position_ids``, ``labels`` (the token
    at a slot when it is scored, else -100), ``valid`` (False for keys nobody attends to: bin padding, completion
    padding inside a row), ``segment`` (each slot's segment, -1 for bin padding), ``ranges`` (segments, 3, 2) as
    ``placement.ranges_host``; ``holes``: some slot inside a segment is not valid."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    segment: torch.Tensor
    ranges: torch.Tensor
    holes: bool


def build_stream(
    placement: Placement,
    source_ids: torch.Tensor,
    source_valid: torch.Tensor | None,
    pad_token_id: int = 0,
) -> Stream:
    """Gather `placement`'s segments from ``source_ids`` (rows, width): one indexing op per field."""
    device = source_ids.device
    width = source_ids.size(1)
    specs, length, binned = placement.specs, placement.length, placement.binned
    table = torch.tensor(
        [
            (s.row * width + s.col, s.length, s.position, int(s.scored), (s.bin if binned else 0) * length + start)
            for s, start in zip(specs, placement.starts, strict=True)
        ],
        dtype=torch.long,
    ).to(device)
    source, lengths, position, scored, slot = table.unbind(1)
    total = sum(s.length for s in specs)
    segment = torch.repeat_interleave(torch.arange(len(specs), device=device), lengths, output_size=total)
    offset = torch.arange(total, device=device) - (torch.cumsum(lengths, 0) - lengths)[segment]
    src = source[segment] + offset
    ids = source_ids.reshape(-1)[src]
    valid = torch.ones_like(ids, dtype=torch.bool) if source_valid is None else source_valid.reshape(-1)[src].bool()
    labels = torch.where(scored[segment].bool() & (offset > 0) & valid, ids, -100)
    pos = position[segment] + offset

    def layout(values, fill_value, dtype):
        if not binned:
            return values.to(dtype).unsqueeze(0)
        out = torch.full((placement.rows * length,), fill_value, dtype=dtype, device=device)
        out[slot[segment] + offset] = values.to(dtype)
        return out.view(placement.rows, length)

    return Stream(
        input_ids=layout(ids, pad_token_id, torch.long),
        position_ids=layout(pos, 0, torch.long),
        labels=layout(labels, -100, torch.long),
        valid=layout(valid, False, torch.bool),
        segment=layout(segment, -1, torch.long),
        ranges=torch.tensor(placement.ranges_host, dtype=torch.long).reshape(-1, 3, 2).to(device),
        holes=not bool(valid.all()),
    )


def dense_visibility(
    segment: torch.Tensor,
    ranges: torch.Tensor,
    key_length: int,
    query_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """(batch, 1, T, key_length) bool: query slot q (segment ``segment[b, q]``) sees key k iff k is in its prefix
    or rest range, or in its own range up to its own key (``query_offset + q``), and ``key_valid[b, k]``.
    Padding slots (segment -1) see themselves only (a query with no key would give NaN)."""
    n, length = segment.shape
    device = segment.device
    k = torch.arange(key_length, device=device).view(1, 1, key_length)
    q = torch.arange(length, device=device).view(1, length, 1) + query_offset
    r = ranges[segment.clamp(min=0)].unsqueeze(-1)  # (batch, T, 3, 2, 1)
    seen = (k >= r[:, :, 0, 0]) & (k < r[:, :, 0, 0] + r[:, :, 0, 1])
    seen |= (k >= r[:, :, 1, 0]) & (k < r[:, :, 1, 0] + r[:, :, 1, 1])
    seen |= (k >= r[:, :, 2, 0]) & (k <= q)
    if key_valid is not None:
        seen &= key_valid.view(n, 1, key_length)
    seen = torch.where((segment < 0).unsqueeze(2), k == q, seen)
    return seen.unsqueeze(1)


def eager_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`visible` (bool) as eager attention's additive float mask."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)
