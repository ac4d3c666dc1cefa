"""Reshard execution: bit-for-bit round trips through bounded staging (Ray actors, gloo, CPU)."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from _actors import KINDS, bitwise_equal, full_state, start_world  # noqa: E402

from dynaresize.reshard.execute import execute_plan  # noqa: E402
from dynaresize.reshard.layout import FlatLayout  # noqa: E402
from dynaresize.reshard.plan import chunk_elems_for, transfer_plan  # noqa: E402

NUM_DEVICES = 4
NUMEL = 997  # odd, so shards are unbalanced by one
BIG = 1 << 20  # larger than the whole state
SMALL = 64  # far smaller than a shard: 4 elements of 16 packed bytes per message
BPE = sum(torch.empty((), dtype=d).element_size() for d in KINDS.values())


@pytest.fixture(scope="module")
def actors():
    ray.init(address="local", num_cpus=NUM_DEVICES, include_dashboard=False, logging_level="ERROR")
    try:
        handles, _, _ = start_world(NUM_DEVICES)
        yield handles
    finally:
        ray.shutdown()


def _on_all(actors, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in actors], timeout=120)


def _check_layout(actors, full, ranks):
    """Every actor holds exactly its slice of `full` under the layout over `ranks`, bit for bit."""
    layout = FlatLayout(NUMEL, ranks)
    for rank, shards in enumerate(_on_all(actors, "get_shards")):
        lo, hi = layout.shard_range(rank) if rank in layout.ranks else (0, 0)
        assert set(shards) == set(full)
        for k, v in full.items():
            assert bitwise_equal(shards[k], v[lo:hi]), (rank, k)


# --- no world needed: checks that run before any message, and purely local plans ----------


def test_local_only_plan_needs_no_messages():
    full = full_state(50, seed=1)
    plan = transfer_plan(50, (0,), (0,), chunk_elems=7)
    new, stats = execute_plan(plan, rank=0, old_shards=full, new_numel_local=50, staging_bytes=64)
    assert all(bitwise_equal(new[k], full[k]) for k in full)
    assert stats.num_messages == 0 and stats.peak_staging_bytes == 0 and stats.bytes_local == 50 * BPE


def test_rank_without_old_state_gets_empty_shards_of_the_right_dtypes():
    plan = transfer_plan(30, (0,), (0,), chunk_elems=4)
    new, stats = execute_plan(plan, rank=1, old_shards=None, new_numel_local=0, staging_bytes=64, dtypes=KINDS)
    assert {k: (v.dtype, v.numel()) for k, v in new.items()} == {k: (d, 0) for k, d in KINDS.items()}
    assert stats.num_messages == 0 and stats.bytes_sent == 0


def test_bad_inputs_are_refused_before_any_message():
    full = full_state(40, seed=2)
    plan = transfer_plan(40, (0,), (0, 1), chunk_elems=10)  # 10 * 16 packed bytes per chunk
    assert BPE == 16
    with pytest.raises(ValueError, match="staging_bytes: a chunk of 160"):
        execute_plan(plan, rank=0, old_shards=full, new_numel_local=20, staging_bytes=159)
    with pytest.raises(ValueError, match="new_numel_local"):
        execute_plan(plan, rank=0, old_shards=full, new_numel_local=21, staging_bytes=200)
    with pytest.raises(ValueError, match="old_shards"):
        execute_plan(plan, rank=0, old_shards={k: v[:5] for k, v in full.items()}, new_numel_local=20, staging_bytes=200)
    with pytest.raises(ValueError, match="neither an old shard nor a dtype"):
        execute_plan(plan, rank=1, old_shards=None, new_numel_local=20, staging_bytes=200, kinds=["param"])


# --- Ray actors and gloo -------------------------------------------------------------------


@pytest.mark.parametrize("staging_bytes", [SMALL, BIG], ids=["staging64B", "staging1MiB"])
@pytest.mark.parametrize(
    "w, w2",
    [((0, 1, 2, 3), (1, 2, 3)), ((0, 1, 2, 3), (3,)), ((2, 3), (0, 1, 2, 3)), ((0, 1, 3), (1, 2))],
    ids=["4-3-4", "4-1-4", "2-4-2", "3-2-3"],
)
def test_round_trip_is_bitwise_identity(actors, w, w2, staging_bytes):
    seed = hash((w, w2, staging_bytes)) % 1000
    full = full_state(NUMEL, seed)
    _on_all(actors, "load", NUMEL, w, seed)
    there = _on_all(actors, "reshard", w2, staging_bytes)
    _check_layout(actors, full, w2)
    back = _on_all(actors, "reshard", w, staging_bytes)
    _check_layout(actors, full, w)
    for stats in there + back:
        assert stats["peak_staging_bytes"] <= staging_bytes
    # Bytes balance: what was sent is what was received, and every element moved once.
    for leg in (there, back):
        assert sum(s["bytes_sent"] for s in leg) == sum(s["bytes_received"] for s in leg)
        assert sum(s["bytes_sent"] + s["bytes_local"] for s in leg) == NUMEL * BPE
    if staging_bytes == SMALL:
        chunk = chunk_elems_for(SMALL, BPE)
        remote = sum(s["bytes_sent"] for s in there) // BPE
        assert sum(s["num_messages"] for s in there) >= 2 * remote // chunk  # sender + receiver


def test_two_passes_of_kinds_equal_one_pass_with_background_group(actors):
    """Params on the world group (critical), then moments and counters on a separate
    "background" group in a thread while the new trainers run all-reduces (issue 4)."""
    w, w2 = (0, 1, 2, 3), (1, 2, 3)
    full = full_state(NUMEL, seed=7)
    _on_all(actors, "create", [w2], False, "")
    _on_all(actors, "create", [tuple(range(NUM_DEVICES))], False, "background")
    _on_all(actors, "load", NUMEL, w, 7)
    one_pass = [{k: v for k, v in s.items()} for s in _on_all(actors, "reshard", w2, 256)]
    after_one = _on_all(actors, "get_shards")

    _on_all(actors, "load", NUMEL, w, 7)
    _on_all(actors, "reshard", w2, 256, ["param"])
    ray.get([a.reshard_in_background.remote(w2, 256, ["count", "exp_avg"], "background") for a in actors])
    # Meanwhile the main thread of each new trainer runs collectives on the training group.
    sums = _on_all(actors, "all_reduce", w2, 1.0, 20)
    assert sums == [None, 3.0, 3.0, 3.0]
    background = _on_all(actors, "join_background")
    after_two = _on_all(actors, "get_shards")
    for a, b in zip(after_one, after_two):
        assert set(a) == set(b) == set(KINDS)
        assert all(bitwise_equal(a[k], b[k]) for k in a)
    _check_layout(actors, full, w2)
    assert all(s["peak_staging_bytes"] <= 256 for s in one_pass + background)


def test_world_still_joined_once_after_reshards_and_groups(actors):
    assert _on_all(actors, "world_inits") == [1] * NUM_DEVICES


@pytest.mark.slow
def test_measure_reshard_throughput(actors):
    """Figures for docs/reshard.md (not asserted on): ~40 MB of state, 4 -> 3 -> 4."""
    numel = 40_000_000 // BPE
    _on_all(actors, "load", numel, (0, 1, 2, 3), 3)
    for staging in (1 << 20, 64 << 10):
        for w2 in ((1, 2, 3), (0, 1, 2, 3)):
            t0 = time.perf_counter()
            stats = _on_all(actors, "reshard", w2, staging)
            wall = time.perf_counter() - t0
            moved = sum(s["bytes_sent"] for s in stats)
            slowest = max(s["seconds"] for s in stats)
            print(
                f"\nstaging={staging} -> {w2}: moved {moved / 1e6:.1f} MB over the network in "
                f"{slowest:.3f} s ({moved / 1e6 / slowest:.0f} MB/s; driver wall {wall:.3f} s); "
                f"peak staging {max(s['peak_staging_bytes'] for s in stats)} B; "
                f"messages {sum(s['num_messages'] for s in stats)}"
            )
            assert all(s["peak_staging_bytes"] <= staging for s in stats)
    _check_layout_n(actors, numel, 3)


def _check_layout_n(actors, numel, seed):
    full = full_state(numel, seed)
    layout = FlatLayout(numel, (0, 1, 2, 3))
    for rank, shards in enumerate(_on_all(actors, "get_shards")):
        lo, hi = layout.shard_range(rank)
        assert all(bitwise_equal(shards[k], v[lo:hi]) for k, v in full.items())
