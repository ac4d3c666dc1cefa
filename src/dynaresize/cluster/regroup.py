"""Re-forming the cluster on the surviving devices after a loss (driver side).

Order, each step bounded by a deadline (docs/faults.md):
1. `settle`: every survivor first aborts its communicators from its `ctl` thread
   (`abort_comms`: NCCL's abort frees an issuing thread blocked with the lost peer at once;
   comm/rendezvous.py), then its issuing thread finishes what it was doing. A
   survivor inside a collective with the lost peer is freed by that group's timeout
   (`timeouts.collective_s`), so one still busy `collective_s + margin` later is wedged: it
   is returned as lost too, with the reason;
2. `kill`: the lost workers' actors are killed (`ray.kill`): a stopped process is ended, not
   left hanging, and a died one is already gone;
3. `new_generation`: the survivors, renumbered 0..M-1 in their old order, leave the old world
   and join generation g+1 on a fresh port hosted by the new rank 0 (a fresh TCP store: no
   key or group name of the old world can match), their pools cleared; then the groups of
   the new split and the background group are created in one order on every rank, as at
   start, and the neighbouring splits are pre-warmed.
"""

from __future__ import annotations

from typing import Any

import ray

from dynaresize.cluster.watchdog import DevicesLost
from dynaresize.cluster.worker_resize import BACKGROUND_TAG
from dynaresize.comm import rendezvous
from dynaresize.types import Assignment


def settle(cluster: Any, survivors: list[int]) -> dict[int, str]:
    """Wait until no survivor runs anything of the old world; returns the wedged ones (rank -> why)."""
    if not survivors:
        return {}
    deadline_s = cluster.watchdog.collective_s + cluster.watchdog.margin_s
    wedged: dict[int, str] = {}
    for method, where in (("abort_comms", "abort communicators after a loss"), ("settle", "settle after a loss")):
        calls = [(r, getattr(cluster.workers[r], method).remote()) for r in survivors if r not in wedged]
        try:
            cluster.wait(calls, where, deadline_s=deadline_s)
        except DevicesLost as exc:
            wedged.update({r: why for r, why in exc.lost.items() if r in survivors})
    return wedged


def kill(cluster: Any, ranks: list[int]) -> None:
    for r in ranks:
        try:
            ray.kill(cluster.workers[r], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def new_generation(cluster: Any, survivors: list[int], assignment: Assignment) -> list[dict]:
    """Renumber the survivors, join them into a new world generation, create the split's groups."""
    if assignment.num_devices != len(survivors):
        raise ValueError(f"assignment for {assignment.num_devices} devices, {len(survivors)} survivors")
    cluster.workers = [cluster.workers[r] for r in survivors]
    cluster.ids = [cluster.ids[r] for r in survivors]
    cluster.num_devices = len(survivors)
    cluster.generation += 1
    cluster.watchdog.clear(cluster.num_devices)
    cluster.forget_groups()  # settled: pre-warms ran (or failed) in the old world, whose groups are gone
    cluster.bounds = cluster.bounds.on_survivors(cluster.num_devices)
    deadline_s = cluster.watchdog.collective_s + cluster.watchdog.margin_s
    port = cluster.wait([(0, cluster.workers[0].free_port.remote())], "new world", deadline_s)[0]
    ip = cluster.wait([(0, cluster.workers[0].info.remote())], "new world", deadline_s)[0]["ip"]
    init_method = rendezvous.world_init_method(ip, port)
    n, gen = cluster.num_devices, cluster.generation
    out = cluster.wait([(r, w.reset_world.remote(init_method, r, n, gen)) for r, w in enumerate(cluster.workers)],
                       f"world generation {gen}", deadline_s)
    for r, res in enumerate(out):
        cluster.on_event("comm", {"event": "world_init", "ranks": list(range(n)), "critical": True,
                                  "device": cluster.ids[r], "seconds": res["t1"] - res["t_destroyed"],
                                  "generation": gen})
    cluster.assignment = assignment
    cluster._create_groups([tuple(range(n))], critical=True, tag=BACKGROUND_TAG)
    cluster._create_groups(cluster._split_sets(assignment), critical=True)
    cluster._prewarm_futures = cluster._prewarm(assignment)
    return out
