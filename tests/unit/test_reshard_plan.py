"""Property tests of the pure reshard layout and transfer plan (no torch, milliseconds)."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaresize.reshard.layout import FlatLayout
from dynaresize.reshard.plan import Transfer, chunk_elems_for, plan_bytes, transfer_plan

rank_sets = st.sets(st.integers(min_value=0, max_value=7), min_size=1, max_size=6).map(
    lambda s: tuple(sorted(s))
)


def _apply(plan, numel, old_ranks, new_ranks, shards):
    """Run a plan on Python lists: shards maps rank -> list (its old shard)."""
    old = FlatLayout(numel, old_ranks)
    new = FlatLayout(numel, new_ranks)
    out = {r: [None] * new.local_numel(r) for r in new.ranks}
    for t in plan:
        olo = old.shard_range(t.src)[0]
        nlo = new.shard_range(t.dst)[0]
        out[t.dst][t.lo - nlo : t.hi - nlo] = shards[t.src][t.lo - olo : t.hi - olo]
    return out


@given(numel=st.integers(0, 500), ranks=rank_sets)
def test_layout_balanced_contiguous_cover(numel, ranks):
    layout = FlatLayout(numel, tuple(reversed(ranks)))
    assert layout.ranks == ranks
    ranges = layout.owner_ranges()
    assert [r for r, _, _ in ranges] == list(ranks)
    assert ranges[0][1] == 0 and ranges[-1][2] == numel
    for (_, _, hi), (_, lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo
    sizes = [hi - lo for _, lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
    for r, lo, hi in ranges:
        assert layout.shard_range(r) == (lo, hi)
        assert layout.local_numel(r) == hi - lo
        for i in {lo, hi - 1} if hi > lo else ():
            assert layout.owner_of(i) == r


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="ranks"):
        FlatLayout(10, ())
    with pytest.raises(ValueError, match="duplicates"):
        FlatLayout(10, (1, 1))
    with pytest.raises(ValueError, match="numel"):
        FlatLayout(-1, (0,))
    layout = FlatLayout(10, (0, 2))
    with pytest.raises(ValueError, match="rank: 1"):
        layout.shard_range(1)
    assert layout.local_numel(1) == 0


@given(numel=st.integers(0, 400), old=rank_sets, new=rank_sets, chunk=st.integers(1, 64))
def test_plan_covers_each_element_once_from_its_owner(numel, old, new, chunk):
    plan = transfer_plan(numel, old, new, chunk_elems=chunk)
    old_l, new_l = FlatLayout(numel, old), FlatLayout(numel, new)
    seen = [0] * numel
    for t in plan:
        assert isinstance(t, Transfer)
        assert 0 < t.hi - t.lo <= chunk
        for i in (t.lo, t.hi - 1):
            assert old_l.owner_of(i) == t.src and new_l.owner_of(i) == t.dst
        for i in range(t.lo, t.hi):
            seen[i] += 1
    assert seen == [1] * numel
    # Local copies are included, and each rank that keeps an element keeps it locally.
    local = sum(t.numel for t in plan if t.is_local)
    kept = sum(
        max(0, min(ohi, nhi) - max(olo, nlo))
        for r in set(old) & set(new)
        for olo, ohi in [old_l.shard_range(r)]
        for nlo, nhi in [new_l.shard_range(r)]
    )
    assert local == kept


@given(
    staging=st.integers(1, 1 << 20),
    kinds=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
    numel=st.integers(0, 3000),
    old=rank_sets,
    new=rank_sets,
)
@settings(max_examples=60)
def test_packed_chunk_bytes_never_exceed_the_bound(staging, kinds, numel, old, new):
    bpe = sum(kinds)
    if staging < bpe:
        with pytest.raises(ValueError, match="staging_bytes"):
            chunk_elems_for(staging, bpe)
        return
    chunk = chunk_elems_for(staging, bpe)
    assert chunk * bpe <= staging < (chunk + 1) * bpe
    for t in transfer_plan(numel, old, new, chunk_elems=chunk):
        assert t.numel * bpe <= staging


@given(numel=st.integers(0, 300), w=rank_sets, w2=rank_sets, c1=st.integers(1, 40), c2=st.integers(1, 40))
def test_round_trip_is_identity(numel, w, w2, c1, c2):
    full = list(range(numel))
    layout = FlatLayout(numel, w)
    shards = {r: full[lo:hi] for r, lo, hi in layout.owner_ranges()}
    there = _apply(transfer_plan(numel, w, w2, chunk_elems=c1), numel, w, w2, shards)
    new_l = FlatLayout(numel, w2)
    assert there == {r: full[lo:hi] for r, lo, hi in new_l.owner_ranges()}
    back = _apply(transfer_plan(numel, w2, w, chunk_elems=c2), numel, w2, w, there)
    assert back == shards


@given(numel=st.integers(0, 300), old=rank_sets, new=rank_sets, chunk=st.integers(1, 40), seed=st.integers(0, 99))
def test_plan_is_the_same_whatever_the_order_ranks_are_given_in(numel, old, new, chunk, seed):
    rng = random.Random(seed)
    old_shuffled, new_shuffled = list(old), list(new)
    rng.shuffle(old_shuffled)
    rng.shuffle(new_shuffled)
    assert transfer_plan(numel, old, new, chunk_elems=chunk) == transfer_plan(
        numel, old_shuffled, new_shuffled, chunk_elems=chunk
    )


def test_plan_examples_and_interleaving():
    # 4 -> 3 over 12 elements: old shards of 3, new shards of 4.
    plan = transfer_plan(12, (0, 1, 2, 3), (0, 1, 2), chunk_elems=1)
    pieces = {(t.src, t.dst) for t in plan}
    assert pieces == {(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2)}
    # Round-robin: the first chunk of every piece comes before any piece's second chunk.
    first = [(t.src, t.dst) for t in plan[:6]]
    assert len(set(first)) == 6
    assert plan_bytes(plan, 12) == {"remote_bytes": 6 * 12, "local_bytes": 6 * 12}
    assert transfer_plan(0, (0,), (1,), chunk_elems=4) == ()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="chunk_elems"):
        transfer_plan(10, (0,), (1,), chunk_elems=0)
    with pytest.raises(ValueError, match="bytes_per_elem_total"):
        chunk_elems_for(64, 0)
    with pytest.raises(ValueError, match="staging_bytes"):
        chunk_elems_for(11, 12)


def test_pure_modules_import_no_torch():
    for name in ("dynaresize.reshard.layout", "dynaresize.reshard.plan"):
        mod = sys.modules[name]
        assert "torch" not in mod.__dict__
    assert "import torch" not in open(sys.modules["dynaresize.reshard.plan"].__file__).read()
    assert "import torch" not in open(sys.modules["dynaresize.reshard.layout"].__file__).read()
