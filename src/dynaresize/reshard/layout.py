"""Layouts: which ranges of a flat state vector each rank owns (layout descriptors).

Trainer state of one kind (parameters, an optimizer moment, ...) is flattened into a single
vector of `numel` elements, in a fixed order that does not depend on the number of training
devices (the trainable parameters in `named_parameters()` order, each row-major). A layout
says which ranges of that vector each rank owns; the reshard planner and executor, snapshots
and checkpoints work from a layout's pieces only, so a trainer backend with another sharding
rule adds a layout here (and `layout_from` learns its descriptor) without touching the planner,
the executor or the checkpoint format; the backend itself says which layout it uses.

- `FlatLayout`: one balanced contiguous range per rank (a ZeRO-style flat shard).
- `RowChunkLayout`: torch FSDP2's rule (`fully_shard`, `Shard(0)` per parameter): parameter p
  with `rows` rows is cut in chunks of `ceil(rows / W)` rows; rank i holds rows
  `[i*c, min((i+1)*c, rows))` (possibly none), so a rank owns one range per parameter.

Pure: no torch, no I/O. Every rank computes the same layout from the same arguments.

Invariants (every layout):
- `ranks` is sorted and has no duplicates.
- `pieces()` lists non-empty `(rank, lo, hi)` in ascending `lo`; they tile `[0, numel)`.
- A rank's local storage of a kind is its pieces in ascending `lo`, concatenated
  (`rank_pieces(rank)`); `local_numel(rank)` is their total (0 for a rank outside).
- `describe()` is JSON-able and `layout_from(describe())` rebuilds an equal layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

Piece = tuple[int, int, int]  # (rank, lo, hi)


class Layout(Protocol):
    numel: int
    ranks: tuple[int, ...]

    def pieces(self) -> tuple[Piece, ...]: ...

    def rank_pieces(self, rank: int) -> tuple[tuple[int, int], ...]: ...

    def local_numel(self, rank: int) -> int: ...

    def describe(self) -> dict: ...


def _check_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError("ranks: must name at least one rank, got ()")
    if any((not isinstance(r, int)) or r < 0 for r in ranks):
        raise ValueError(f"ranks: must be ints >= 0, got {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks: duplicates in {ranks!r}")
    # Sorting makes the layout independent of the order a caller listed the ranks in.
    return tuple(sorted(ranks))


@dataclass(frozen=True)
class FlatLayout:
    """Which contiguous range of a flat vector of `numel` elements each rank owns."""

    numel: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"numel: must be an int >= 0, got {self.numel!r}")
        object.__setattr__(self, "ranks", _check_ranks(self.ranks))

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

    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.owner_ranges() if p[2] > p[1])

    def rank_pieces(self, rank: int) -> tuple[tuple[int, int], ...]:
        if rank not in self.ranks:
            return ()
        lo, hi = self.shard_range(rank)
        return ((lo, hi),) if hi > lo else ()

    def describe(self) -> dict:
        return {"kind": "flat", "numel": self.numel, "ranks": list(self.ranks)}

    def owner_of(self, index: int) -> int:
        """The rank that owns element `index`."""
        if not 0 <= index < self.numel:
            raise ValueError(f"index: {index} is outside [0, {self.numel})")
        base, extra = divmod(self.numel, len(self.ranks))
        split = extra * (base + 1)  # the first `extra` ranks hold base + 1 elements
        position = index // (base + 1) if index < split else extra + (index - split) // base
        return self.ranks[position]


@dataclass(frozen=True)
class RowChunkLayout:
    """FSDP2's per-parameter dim-0 sharding (see the module docstring).

    `shapes` are the (rows, row_numel) of the trainable parameters in flattening order; a 0-d
    parameter counts as one row of one element (FSDP2 shards it as a 1-element vector)."""

    shapes: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        shapes = tuple((int(r), int(n)) for r, n in self.shapes)
        if any(r < 0 or n < 0 for r, n in shapes):
            raise ValueError(f"shapes: rows and row sizes must be >= 0, got {self.shapes!r}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "ranks", _check_ranks(self.ranks))

    @classmethod
    def of_shapes(cls, shapes: Sequence[Sequence[int]], ranks: Sequence[int]) -> "RowChunkLayout":
        """From full parameter shapes (as `tensor.shape`)."""
        rows = []
        for shape in shapes:
            shape = tuple(int(x) for x in shape)
            if not shape:
                rows.append((1, 1))
            else:
                n = 1
                for x in shape[1:]:
                    n *= x
                rows.append((shape[0], n))
        return cls(tuple(rows), tuple(ranks))

    @property
    def numel(self) -> int:
        return sum(r * n for r, n in self.shapes)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def _chunks(self, rows: int) -> list[tuple[int, int]]:
        """Row ranges of each rank position for a parameter of `rows` rows (torch.chunk's rule)."""
        w = len(self.ranks)
        c = -(-rows // w) if rows else 0
        return [(min(i * c, rows), min((i + 1) * c, rows)) for i in range(w)]

    def pieces(self) -> tuple[Piece, ...]:
        out: list[Piece] = []
        off = 0
        for rows, n in self.shapes:
            for pos, (a, b) in enumerate(self._chunks(rows)):
                if b > a and n:
                    out.append((self.ranks[pos], off + a * n, off + b * n))
            off += rows * n
        return tuple(out)

    def rank_pieces(self, rank: int) -> tuple[tuple[int, int], ...]:
        return tuple((lo, hi) for r, lo, hi in self.pieces() if r == rank)

    def local_rows(self, rank: int) -> tuple[int, ...]:
        """Rows `rank` holds of each parameter (0 where it holds none)."""
        if rank not in self.ranks:
            return tuple(0 for _ in self.shapes)
        pos = self.ranks.index(rank)
        return tuple(b - a for a, b in (self._chunks(rows)[pos] for rows, _ in self.shapes))

    def local_numel(self, rank: int) -> int:
        return sum(hi - lo for lo, hi in self.rank_pieces(rank))

    def describe(self) -> dict:
        return {"kind": "row-chunk", "shapes": [list(s) for s in self.shapes], "ranks": list(self.ranks)}


def layout_from(desc: dict[str, Any]) -> "FlatLayout | RowChunkLayout":
    """The layout a `describe()` dict names (snapshots and checkpoints store it)."""
    kind = desc.get("kind")
    if kind == "flat":
        return FlatLayout(int(desc["numel"]), tuple(int(r) for r in desc["ranks"]))
    if kind == "row-chunk":
        return RowChunkLayout(tuple(tuple(s) for s in desc["shapes"]), tuple(int(r) for r in desc["ranks"]))
    raise ValueError(f"layout kind {kind!r}: expected 'flat' or 'row-chunk'")
