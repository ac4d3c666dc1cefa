"""The driver's pre-warm keeps each worker's communicator pool bounded (cluster/cluster.py
`_prewarm` with `CommPool.retain`): on 16 devices, where only the splits within two move units
are pre-warmed, a walk over every split holds at most the current split's, its neighbours' and
the background group, and never asks a worker to keep a group it would need and not have."""

from __future__ import annotations

from dynaresize.cluster.cluster import Cluster
from dynaresize.cluster.worker_resize import BACKGROUND_TAG
from dynaresize.config_load import build_config
from dynaresize.control import planner
from dynaresize.presets import preset
from dynaresize.types import Assignment

N = 16


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Worker:
    """A worker's pool as keys: `prewarm_groups` creates, then keeps only `keep`."""

    def __init__(self) -> None:
        self.held: set[tuple[str, tuple[int, ...]]] = set()
        self.prewarm_groups = _Remote(self._prewarm)

    def _prewarm(self, sets, keep=None):
        self.held |= {("", tuple(s)) for s in sets}
        if keep is not None:
            self.held &= {(tag, tuple(rs)) for tag, rs in keep}
        return "ref"


def test_a_walk_over_every_split_keeps_the_pool_bounded():
    data = preset("cpu")
    data["cluster"] = {**data["cluster"], "devices": N, "rollout_devices": 1}
    cluster = Cluster(build_config(data))
    worker = _Worker()
    cluster.workers = [worker]
    background = (BACKGROUND_TAG, tuple(range(N)))
    worker.held.add(background)
    cluster._known_sets.add((background[1], background[0]))
    a = Assignment.split(N, 1)
    held = []
    for target in [*range(2, N), *range(N - 2, 0, -1)]:  # 28 moves, one unit each
        current = {("", tuple(s)) for s in cluster._split_sets(a)}
        worker.held |= current  # the resize made the current split's groups (create_split_groups)
        cluster._known_sets |= {(rs, tag) for tag, rs in current}
        cluster._prewarm(a)
        cluster._known_sets |= {(tuple(rs), "") for rs in cluster._prewarm_sets}  # waited for (finish_background)
        assert current | {background} <= worker.held  # nothing in use is destroyed
        assert worker.held == {(tag, rs) for rs, tag in cluster._known_sets}  # the driver knows what is held
        held.append(len(worker.held))
        a = planner.plan_resize(resize_id=0, step=0, src=a, target_rollout=target).dst
    # the current split and the splits within two units (4 of them at most): 2 groups each, + background
    assert max(held) <= 1 + 2 * 5 < 2 * (N - 1) + 1  # without destroying: every split ever visited
    assert held[len(held) // 2] <= 11
