"""One-step-off dispatch: each rollout replica gets its whole share at once, the simulator's split
(position p = prompt x samples + sample to replica p mod R), whatever order the groups come in."""

import pytest

from dynaresize.pipeline.dispatch import batch_position, replica_shares, stream_shares


def _ids(prompts, samples, step=3):
    return [(step, p, s) for p in range(prompts) for s in range(samples)]


def test_shares_are_the_simulators_split():
    ids = _ids(16, 4)
    shares = replica_shares(ids, 2, 4)
    assert [len(s) for s in shares] == [32, 32]
    assert all(batch_position(ids[i], 4) % 2 == j for j, share in enumerate(shares) for i in share)
    assert sorted(i for s in shares for i in s) == list(range(64))  # every request once


def test_order_of_the_groups_does_not_change_a_share():
    ids = _ids(6, 4)
    shuffled = ids[12:] + ids[:12]
    a = [[ids[i] for i in s] for s in replica_shares(ids, 4, 4)]
    b = [[shuffled[i] for i in s] for s in replica_shares(shuffled, 4, 4)]
    assert a == b


def test_a_subset_goes_to_the_replicas_its_positions_name_and_empty_shares_are_dropped():
    ids = [(0, 0, 0), (0, 0, 2), (0, 1, 0)]  # positions 0, 2, 4 on 2 replicas: all on replica 0
    assert replica_shares(ids, 2, 4) == [[0, 1, 2]]
    assert replica_shares(ids, 8, 4) == [[0], [1], [2]]


def test_bad_input():
    with pytest.raises(ValueError, match="num_replicas"):
        replica_shares(_ids(1, 2), 0, 2)
    with pytest.raises(ValueError, match="twice"):
        replica_shares([(0, 0, 0), (0, 0, 0)], 2, 2)


def test_stream_shares_are_consecutive_runs_at_most_an_engines_slots():
    ids = _ids(16, 4)
    shuffled = ids[40:] + ids[:40]
    shares = [[shuffled[i] for i in s] for s in stream_shares(shuffled, 2, 4, slots=64)]
    assert shares == [ids[:32], ids[32:]]  # ceil(64 / 2) consecutive samples each, whole groups
    assert [len(s) for s in stream_shares(ids, 2, 4, slots=20)] == [20, 20, 20, 4]  # capped at the slots
    assert [len(s) for s in stream_shares(ids, 3, 4, slots=64)] == [22, 22, 20]
    assert stream_shares(ids[:3], 8, 4, slots=64) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="slots"):
        stream_shares(ids, 2, 4, slots=0)
    with pytest.raises(ValueError, match="twice"):
        stream_shares([(0, 0, 0), (0, 0, 0)], 2, 2, slots=4)
