"""Dynamic sampling (DAPO's group filter, arXiv 2503.14476 §3.2): the decision both execution paths share.

A step needs ``groups_needed`` informative prompt groups. Each generation batch's groups are judged by the
degenerate-group rule (`trl_grpo_ext.grpo.losses.degenerate_groups`, applied by the trainer / the PyTRIO loop with
``degenerate_tol`` and ``degenerate_reward``); `GroupFilter` keeps the informative ones in the order they were
generated and says when to stop: once every partition has its share, or after ``max_generation_batches`` batches.
Then the step trains on what there is: the missing groups are padding that contributes nothing (the TRL path keeps
its fixed batch shape with masked-out degenerate groups, the PyTRIO path sends fewer datums).

Partitions are the processes of a multi-process TRL run: a process trains only on groups it generated (no
tensors move between processes), so each of the ``num_partitions`` equal slices of a generation batch fills its
own share. The decision reads the degenerate mask of the whole (gathered) batch, so every process stops after
the same number of batches. The PyTRIO loop has one partition.

Pure Python (no torch): the TRL mixin (`trl_grpo_ext.trl.sampling`) and `trl_grpo_ext.pytrio.loop` both call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupRef:
    """One group of one generation batch: ``batch`` (0-based, in generation order), ``group`` (index within the
    partition's slice of that batch) and whether it is padding (a degenerate group standing in for a missing one)."""

    batch: int
    group: int
    padding: bool = False


@dataclass
class GroupFilter:
    """Keeps informative groups of successive generation batches until the step has ``groups_needed`` of them.

    ``groups_needed``: groups of one generation batch (all partitions). ``num_partitions`` must divide it.
    ``max_generation_batches``: generation batches one step may use, the first included (>= 1).
    """

    groups_needed: int
    max_generation_batches: int
    num_partitions: int = 1
    generation_batches: int = 0
    groups_seen: int = 0
    degenerate_seen: int = 0
    _kept: list[list[GroupRef]] = field(default_factory=list, repr=False)
    _degenerate: list[list[GroupRef]] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.groups_needed < 1:
            raise ValueError(f"groups_needed must be >= 1, got {self.groups_needed}")
        if self.max_generation_batches < 1:
            raise ValueError(f"max_generation_batches must be >= 1, got {self.max_generation_batches}")
        if self.num_partitions < 1 or self.groups_needed % self.num_partitions:
            raise ValueError(
                f"{self.groups_needed} groups per batch do not split into {self.num_partitions} equal partitions"
            )
        self._kept = [[] for _ in range(self.num_partitions)]
        self._degenerate = [[] for _ in range(self.num_partitions)]

    @property
    def per_partition(self) -> int:
        return self.groups_needed // self.num_partitions

    def add(self, degenerate: Sequence[bool]) -> None:
        """Record one generation batch: ``degenerate[g]`` for each of its ``groups_needed`` groups (all partitions,
        partition ``p`` holding groups ``[p * per_partition, (p + 1) * per_partition)``)."""
        if self.done:
            raise RuntimeError("GroupFilter.add after the filter is done")
        if len(degenerate) != self.groups_needed:
            raise ValueError(f"a generation batch has {self.groups_needed} groups, got {len(degenerate)} flags")
        batch = self.generation_batches
        for index, flag in enumerate(degenerate):
            partition, group = divmod(index, self.per_partition)
            ref = GroupRef(batch, group)
            (self._degenerate if flag else self._kept)[partition].append(ref)
        self.generation_batches += 1
        self.groups_seen += len(degenerate)
        self.degenerate_seen += sum(bool(flag) for flag in degenerate)

    @property
    def informative_kept(self) -> int:
        """Informative groups the step trains on (all partitions)."""
        return sum(min(len(kept), self.per_partition) for kept in self._kept)

    @property
    def full(self) -> bool:
        return all(len(kept) >= self.per_partition for kept in self._kept)

    @property
    def done(self) -> bool:
        """Stop generating: every partition is full, or the batch budget is spent."""
        return self.full or self.generation_batches >= self.max_generation_batches

    def selection(self, partition: int = 0) -> list[GroupRef]:
        """The ``per_partition`` groups ``partition`` trains on: its informative groups in generation order, then
        (only when the budget ran out) its first degenerate groups as padding, marked ``padding=True``."""
        if not self.done:
            raise RuntimeError("GroupFilter.selection before the filter is done")
        chosen = self._kept[partition][: self.per_partition]
        missing = self.per_partition - len(chosen)
        padding = [GroupRef(ref.batch, ref.group, padding=True) for ref in self._degenerate[partition][:missing]]
        return chosen + padding

    def metrics(self) -> dict[str, float]:
        """``generation_batches``, ``frac_degenerate_before_filter`` (of every group generated for the step) and
        ``frac_degenerate`` (of the groups the step trains on: the padding left when the budget ran out)."""
        return {
            "generation_batches": float(self.generation_batches),
            "frac_degenerate_before_filter": self.degenerate_seen / max(self.groups_seen, 1),
            "frac_degenerate": 1.0 - self.informative_kept / self.groups_needed,
        }
