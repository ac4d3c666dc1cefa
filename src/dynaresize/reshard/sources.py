"""Reading global ranges of saved trainer state, whatever layout it was saved in.

A saved shard (a checkpoint file, an in-memory snapshot) holds one rank's pieces of a layout
(reshard/layout.py): global ranges `[lo, hi)` of the flat state, stored concatenated in
ascending `lo` as one flat array per state kind. `ShardSource` stitches any global range out of
a set of such shards, reading only the overlapping parts (`fetch` is told the local range), so
state saved at W ranks in one layout loads at W' ranks in another.

Invariants: the shards' pieces tile `[0, numel)` (checked at construction), or, for a source
built from only the shards a reader needs (`partial=True`), do not overlap; `read` returns a
fresh tensor of exactly `hi - lo` elements or raises (a range no shard covers is a ValueError).
"""

from __future__ import annotations

import bisect
from typing import Callable, Mapping, Sequence

import torch

Fetch = Callable[[str, int, int], torch.Tensor]  # (kind, local lo, local hi) -> 1-D tensor


def check_tiling(pieces: Sequence[tuple[int, int]], numel: int, what: str) -> None:
    """ValueError unless `pieces` (any order) tile `[0, numel)` exactly."""
    pos = 0
    for lo, hi in sorted(pieces):
        if lo != pos or hi < lo:
            raise ValueError(f"{what}: pieces do not tile [0, {numel}) at {pos}")
        pos = hi
    if pos != numel:
        raise ValueError(f"{what}: pieces end at {pos}, expected {numel}")


class ShardSource:
    """Global ranges of state kinds, stitched from shards (see the module docstring)."""

    def __init__(self, shards: Sequence[tuple[Sequence[tuple[int, int]], Fetch]], numel: int,
                 what: str = "saved state", *, partial: bool = False) -> None:
        entries = []
        for index, (pieces, _) in enumerate(shards):
            off = 0
            for lo, hi in pieces:
                entries.append((int(lo), int(hi), off, index))
                off += hi - lo
        entries.sort()
        if partial:
            for (_, hi, _, _), (lo, _, _, _) in zip(entries, entries[1:]):
                if lo < hi:
                    raise ValueError(f"{what}: pieces overlap at {lo}")
        else:
            check_tiling([(lo, hi) for lo, hi, _, _ in entries], numel, what)
        self.numel, self.what = numel, what
        self._entries = entries
        self._starts = [e[0] for e in entries]
        self._fetch = [f for _, f in shards]

    def read(self, kind: str, lo: int, hi: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Elements `[lo, hi)` of `kind` (in the saved dtype, or cast to `dtype`)."""
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"range [{lo}, {hi}) outside [0, {self.numel})")
        parts = []
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        pos = lo
        while pos < hi:
            plo, phi, off, shard = self._entries[i] if i < len(self._entries) else (hi, hi, 0, -1)
            if not plo <= pos < phi:
                raise ValueError(f"{self.what}: element {pos} is in no shard given")
            a, b = max(pos, plo), min(hi, phi)
            parts.append(self._fetch[shard](kind, off + a - plo, off + b - plo).reshape(-1))
            pos = b
            i += 1
        if not parts:
            return torch.empty(0, dtype=dtype or torch.float32)
        out = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        return out if dtype is None else out.to(dtype)


def array_fetch(arrays: Mapping[str, object]) -> Fetch:
    """A `Fetch` over in-memory flat arrays (numpy or torch), copied out (they may be read-only)."""
    import numpy as np

    def fetch(kind: str, a: int, b: int) -> torch.Tensor:
        arr = arrays[kind]
        if isinstance(arr, torch.Tensor):
            return arr[a:b].clone()
        return torch.from_numpy(np.array(arr[a:b], copy=True))

    return fetch


def fill_pieces(targets: Mapping[str, Sequence[torch.Tensor]], pieces: Sequence[tuple[int, int]],
                source: ShardSource) -> None:
    """Copy each kind's `pieces` (global ranges) from `source` into the matching 1-D tensors
    of `targets` (empty tensors skipped, as layouts skip empty pieces)."""
    for kind, tensors in targets.items():
        live = [t for t in tensors if t.numel()]
        if [t.numel() for t in live] != [hi - lo for lo, hi in pieces]:
            raise ValueError(f"{kind}: {len(live)} local pieces do not match the layout's {len(pieces)}")
        for (lo, hi), t in zip(pieces, live):
            t.copy_(source.read(kind, lo, hi, dtype=t.dtype))
