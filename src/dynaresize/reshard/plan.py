"""Transfer plan of a reshard: which element ranges go from which old owner to which new one.

When the training world changes from an old layout to a new one (reshard/layout.py: any two
layouts of the same flat vector, e.g. FSDP2's row chunks over `old_ranks` and over
`new_ranks`), every element of every new piece is sent by its single old owner. The plan lists
those moves as `Transfer`s in chunks of at most `chunk_elems` elements, so that a chunk of
every moved state kind, packed together, fits the staging bound. The planner sees only the
layouts' pieces: a new trainer backend adds a layout, not a planner.

Pure: no torch, no I/O. A plan is a value computed identically on every rank from the same
arguments; `execute.execute_plan` walks it in this global order.

Invariants (property-tested in tests/unit/test_reshard_plan.py):
- Coverage: the transfers' `[lo, hi)` ranges partition `[0, numel)`; each element is moved
  exactly once, by its old owner (`src`) to its new owner (`dst`).
- Bounded chunks: `hi - lo <= chunk_elems` for every transfer.
- Local copies (`src == dst`) are transfers too; they need no communication.
- Order: chunks of different (src, dst) pieces are interleaved round-robin (chunk 0 of every
  piece, then chunk 1, ...), so disjoint pairs of ranks can move data at the same time instead
  of waiting on each other along a chain. The order is a pure function of the arguments.
- A plan from W to W' followed by the plan from W' to W returns every element to its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dynaresize.reshard.layout import FlatLayout, Layout


@dataclass(frozen=True)
class Transfer:
    """Move elements `[lo, hi)` (global flat indices) from rank `src` to rank `dst`."""

    src: int
    dst: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def is_local(self) -> bool:
        return self.src == self.dst


def chunk_elems_for(staging_bytes: int, bytes_per_elem_total: int) -> int:
    """Largest chunk (in elements) whose packed bytes fit `staging_bytes`.

    `bytes_per_elem_total` is the sum of the element sizes of every state kind moved in one
    message (fp32 param + exp_avg + exp_avg_sq: 12). ValueError when the bound cannot hold one
    element of every kind.
    """
    if not isinstance(bytes_per_elem_total, int) or bytes_per_elem_total < 1:
        raise ValueError(f"bytes_per_elem_total: must be an int >= 1, got {bytes_per_elem_total!r}")
    if not isinstance(staging_bytes, int) or staging_bytes < bytes_per_elem_total:
        raise ValueError(
            f"staging_bytes: {staging_bytes!r} cannot hold one packed element of "
            f"{bytes_per_elem_total} bytes"
        )
    return staging_bytes // bytes_per_elem_total


def _pieces(old: Layout, new: Layout) -> list[Transfer]:
    """Maximal (src, dst) ranges: intersections of new pieces with old pieces, by ascending lo."""
    pieces: list[Transfer] = []
    old_ranges = list(old.pieces())
    i = 0
    for dst, nlo, nhi in new.pieces():
        lo = nlo
        while lo < nhi:
            while old_ranges[i][2] <= lo:  # advance to the old shard holding element `lo`
                i += 1
            src, _, ohi = old_ranges[i]
            hi = min(nhi, ohi)
            pieces.append(Transfer(src, dst, lo, hi))
            lo = hi
    return pieces


def transfer_plan(
    numel: int,
    old_ranks: Iterable[int],
    new_ranks: Iterable[int],
    *,
    chunk_elems: int,
) -> tuple[Transfer, ...]:
    """The global, deterministic list of chunked transfers that reshards `numel` elements
    between flat layouts over `old_ranks` and `new_ranks`."""
    return layout_plan(FlatLayout(numel, tuple(old_ranks)), FlatLayout(numel, tuple(new_ranks)),
                       chunk_elems=chunk_elems)


def layout_plan(old: Layout, new: Layout, *, chunk_elems: int) -> tuple[Transfer, ...]:
    """The global, deterministic list of chunked transfers from layout `old` to layout `new`."""
    if not isinstance(chunk_elems, int) or chunk_elems < 1:
        raise ValueError(f"chunk_elems: must be an int >= 1, got {chunk_elems!r}")
    if old.numel != new.numel:
        raise ValueError(f"layouts of different vectors: {old.numel} vs {new.numel} elements")
    if old.numel == 0:
        return ()
    chunked: list[list[Transfer]] = []
    for p in _pieces(old, new):
        chunked.append(
            [Transfer(p.src, p.dst, lo, min(lo + chunk_elems, p.hi)) for lo in range(p.lo, p.hi, chunk_elems)]
        )
    plan: list[Transfer] = []
    depth = max(len(c) for c in chunked)
    for k in range(depth):  # round-robin across pieces; see the module docstring
        plan.extend(c[k] for c in chunked if k < len(c))
    return tuple(plan)


def plan_bytes(plan: Iterable[Transfer], bytes_per_elem_total: int) -> dict[str, int]:
    """Bytes the plan moves over the network (`remote_bytes`) and copies in place (`local_bytes`)."""
    remote = local = 0
    for t in plan:
        if t.is_local:
            local += t.numel * bytes_per_elem_total
        else:
            remote += t.numel * bytes_per_elem_total
    return {"remote_bytes": remote, "local_bytes": local}
