"""Flat, balanced sharding of trainer state across a set of ranks.

Trainer state of one kind (parameters, an optimizer moment, ...) is flattened into a single
vector of `numel` elements, in a fixed order that does not depend on the number of training
devices. A `FlatLayout` says which contiguous range of that vector each rank owns.

Pure: no torch, no I/O. Every rank computes the same layout from the same arguments.

Invariants:
- `ranks` is sorted and has no duplicates; the rank at position i owns `[lo_i, hi_i)`.
- Ranges are contiguous, in rank-position order, cover `[0, numel)` exactly once, and are
  balanced: sizes differ by at most 1 (the first `numel % n` ranks hold one more element).
- A rank outside the layout owns nothing (`local_numel` is 0; `shard_range` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlatLayout:
    """Which contiguous range of a flat vector of `numel` elements each rank owns."""

    numel: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"numel: must be an int >= 0, got {self.numel!r}")
        ranks = tuple(self.ranks)
        if not ranks:
            raise ValueError("ranks: must name at least one rank, got ()")
        if any((not isinstance(r, int)) or r < 0 for r in ranks):
            raise ValueError(f"ranks: must be ints >= 0, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks: duplicates in {ranks!r}")
        # Sorting here makes the layout independent of the order a caller listed the ranks in.
        object.__setattr__(self, "ranks", tuple(sorted(ranks)))

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def _bounds(self, position: int) -> tuple[int, int]:
        base, extra = divmod(self.numel, len(self.ranks))
        lo = position * base + min(position, extra)
        hi = lo + base + (1 if position < extra else 0)
        return lo, hi

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The half-open range `[lo, hi)` that `rank` owns; ValueError if it is not a member."""
        try:
            position = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank: {rank} is not in layout ranks {self.ranks}") from None
        return self._bounds(position)

    def local_numel(self, rank: int) -> int:
        """How many elements `rank` owns (0 for a rank outside the layout)."""
        if rank not in self.ranks:
            return 0
        lo, hi = self.shard_range(rank)
        return hi - lo

    def owner_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """`(rank, lo, hi)` for every rank, in ascending `lo` (empty shards included)."""
        return tuple((r, *self._bounds(i)) for i, r in enumerate(self.ranks))

    def owner_of(self, index: int) -> int:
        """The rank that owns element `index`."""
        if not 0 <= index < self.numel:
            raise ValueError(f"index: {index} is outside [0, {self.numel})")
        base, extra = divmod(self.numel, len(self.ranks))
        split = extra * (base + 1)  # the first `extra` ranks hold base + 1 elements
        position = index // (base + 1) if index < split else extra + (index - split) // base
        return self.ranks[position]
