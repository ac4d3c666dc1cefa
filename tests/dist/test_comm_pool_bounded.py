"""The communicator pool stays bounded: groups a device will not use again are destroyed
(`CommPool.retain`), on 4 gloo workers over 20 moves, and a destroyed set made again works."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from _actors import start_world  # noqa: E402

from dynaresize.comm.pool import rank_sets_for_split  # noqa: E402

NUM_DEVICES = 4
BACKGROUND = ("background", tuple(range(NUM_DEVICES)))
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def actors():
    ray.init(address="local", num_cpus=NUM_DEVICES, include_dashboard=False, logging_level="ERROR")
    try:
        yield start_world(NUM_DEVICES)[0]
    finally:
        ray.shutdown()


def _on_all(actors, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in actors], timeout=120)


def _sets(r: int) -> tuple[tuple[int, ...], ...]:
    return rank_sets_for_split(range(r, NUM_DEVICES), range(r))


def test_pool_stays_bounded_over_20_moves(actors):
    _on_all(actors, "create", [BACKGROUND[1]], False, BACKGROUND[0])
    moves = [1, 2, 3, 2] * 5  # 20 moves; each keeps its split and the splits one move away
    held, destroyed = [], 0
    for r in moves:
        current = _sets(r)
        neighbours = [s for n in (r - 1, r + 1) if 1 <= n < NUM_DEVICES for s in _sets(n) if s not in current]
        _on_all(actors, "create", list(current), True)
        _on_all(actors, "create", neighbours, False)
        keep = [BACKGROUND] + [("", s) for s in (*current, *neighbours)]
        gone = _on_all(actors, "retain", keep)
        assert all(g == gone[0] for g in gone)  # the same keys everywhere (the pool's invariant)
        destroyed += len(gone[0])
        stats = _on_all(actors, "stats")
        assert all(s["num_groups"] == len(set(keep)) for s in stats)
        held.append(stats[0]["num_groups"])
        train = current[0]  # the training group works, whether kept or made again
        sums = _on_all(actors, "all_reduce", train, 1.0)
        assert [x for x in sums if x is not None] == [float(len(train))] * len(train)
    assert held[:4] == [5, 7, 5, 7]  # R=1 and R=3 hold 5: the far split's groups were destroyed
    assert max(held) == 7 and stats[0]["num_groups_max"] == 7
    assert destroyed >= 2 * 9 and stats[0]["groups_destroyed"] == destroyed
