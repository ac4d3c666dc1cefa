"""The world is joined once per worker; groups are cached by rank set (Ray actors, gloo, CPU)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from _actors import start_world  # noqa: E402

from dynaresize.cluster.placement import make_placement_group  # noqa: E402
from dynaresize.comm.pool import rank_sets_for_split  # noqa: E402
from dynaresize.errors import UserError  # noqa: E402

NUM_DEVICES = 4
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def world():
    ray.init(address="local", num_cpus=NUM_DEVICES, include_dashboard=False, logging_level="ERROR")
    try:
        actors, pg, init_s = start_world(NUM_DEVICES)
        yield actors, init_s
    finally:
        ray.shutdown()


def _on_all(actors, method, *args, **kwargs):
    return ray.get([getattr(a, method).remote(*args, **kwargs) for a in actors], timeout=120)


def _split(num_rollout: int) -> tuple[tuple[int, ...], ...]:
    rollout = tuple(range(num_rollout))
    train = tuple(range(num_rollout, NUM_DEVICES))
    return rank_sets_for_split(train, rollout)


def test_rank_sets_for_split():
    assert rank_sets_for_split((3, 2), (0, 1)) == ((2, 3), (0, 1, 2))
    assert rank_sets_for_split((1, 2, 3), ()) == ((1, 2, 3),)
    assert rank_sets_for_split((2, 3), (0,), sync_root=3) == ((2, 3), (0, 3))
    with pytest.raises(ValueError, match="train_ranks"):
        rank_sets_for_split((), (0,))
    with pytest.raises(ValueError, match="overlaps"):
        rank_sets_for_split((1, 2), (2,))
    with pytest.raises(ValueError, match="sync_root"):
        rank_sets_for_split((1, 2), (0,), sync_root=0)


def test_placement_too_small_is_a_clear_user_error(world):
    with pytest.raises(UserError, match="devices: 64 devices need 64 CPU"):
        make_placement_group(64, use_gpu=False, cpus_per_device=1.0, timeout_s=1.0)


def test_world_joined_once_and_rejoin_is_a_no_op(world):
    actors, _ = world
    assert _on_all(actors, "world_inits") == [1] * NUM_DEVICES
    init_method = ray.get(actors[0].address.remote())
    # Joining the live generation again changes nothing (and creates no world).
    _on_all(actors, "init", init_method, 0)
    assert _on_all(actors, "world_inits") == [1] * NUM_DEVICES


def test_pool_caches_groups_by_rank_set(world):
    actors, _ = world
    before = _on_all(actors, "stats")[0]
    # First time splits R=1 and R=2 are seen: pre-warm them off the critical path.
    first = _on_all(actors, "create", list(_split(1) + _split(2)), False)
    assert first == [4] * NUM_DEVICES  # (1,2,3), (0,1), (2,3), (0,1,2)
    # Split R=1 again, as the critical path would ask for it: nothing is created.
    again = _on_all(actors, "create", list(_split(1)), True)
    assert again == [0] * NUM_DEVICES
    stats = _on_all(actors, "stats")
    counts = [{k: v for k, v in s.items() if not k.startswith("create_s")} for s in stats]
    assert all(c == counts[0] for c in counts)  # identical on every rank (the pool's invariant)
    s = stats[0]
    assert s["groups_created"] - before["groups_created"] == 4
    assert s["groups_created_background"] - before["groups_created_background"] == 4
    assert s["groups_created_critical"] == before["groups_created_critical"]
    assert s["cache_hits"] - before["cache_hits"] == 2
    assert s["world_inits"] == 1
    # A new split on the critical path is counted as critical.
    assert _on_all(actors, "create", [(0, 3)], True) == [1] * NUM_DEVICES
    assert _on_all(actors, "stats")[0]["groups_created_critical"] == before["groups_created_critical"] + 1


def test_cached_groups_work_and_know_their_members(world):
    actors, _ = world
    _on_all(actors, "create", list(_split(1)), False)
    train = (1, 2, 3)
    views = _on_all(actors, "group_view", train)
    assert views[0] == {"member": False}
    assert [v["group_rank"] for v in views[1:]] == [0, 1, 2]
    assert all(v["size"] == 3 for v in views[1:])
    sums = _on_all(actors, "all_reduce", train, 2.0, 3)
    assert sums == [None, 6.0, 6.0, 6.0]
    # The weight-sync group {1} + {0} works at the same time as its members' other groups.
    assert _on_all(actors, "all_reduce", (0, 1), 1.5) == [3.0, 3.0, None, None]


def test_get_of_a_set_never_created_is_refused(world):
    actors, _ = world
    with pytest.raises(ray.exceptions.RayTaskError, match="driver must create it first"):
        ray.get(actors[0].group_view.remote((0, 1, 2, 3), "never"), timeout=60)


def test_survivors_form_a_new_generation_last(world):
    """Runs last: actors 1..3 (the survivors of a lost actor 0) form generation 1 as ranks 0..2."""
    actors, _ = world
    _on_all(actors, "leave")
    survivors = actors[1:]
    init_method = ray.get(survivors[0].address.remote())
    infos = ray.get([a.rejoin.remote(init_method, i, 3, 1) for i, a in enumerate(survivors)], timeout=120)
    assert [(i["rank"], i["world_size"], i["generation"]) for i in infos] == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    assert _on_all(survivors, "world_inits") == [2, 2, 2]
    # The pool was cleared: the same rank set is created again, with matching names everywhere.
    assert _on_all(survivors, "create", [(0, 1, 2), (1, 2)], True) == [2, 2, 2]
    assert _on_all(survivors, "all_reduce", (1, 2), 2.5) == [None, 5.0, 5.0]
    assert _on_all(survivors, "all_reduce", (0, 1, 2), 1.0) == [3.0, 3.0, 3.0]
