"""The order a resize's ops reach the workers (cluster/resize_ops.py), with a recording stand-in
for the cluster: which worker method runs when, and what the driver waits for.

- Every background op is queued (not waited for) after the critical ones, so on each device it
  runs ahead of any later stage work (the one-issuing-thread rule, cluster/worker.py).
- On GPUs a device leaving training hands its moments on and frees its memory before its engine
  starts (`load_weights`), waited for and recorded as critical. Before: the GPU case failed
  here, the moments were deferred past `load_weights` (to the trainers' next optimizer step),
  so the engine started on a device still holding its moment shards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynaresize.cluster import resize_ops
from dynaresize.cluster.cluster import ResizeOutcome
from dynaresize.cluster.pacing import DriverPacing
from dynaresize.config_load import build_config
from dynaresize.control import planner
from dynaresize.types import Assignment


class _Method:
    def __init__(self, log: list, device: int, name: str) -> None:
        self.log, self.device, self.name = log, device, name

    def remote(self, *args, **kwargs):
        self.log.append(("queued", self.name, self.device))
        return ("ref", self.name, self.device)


class _Worker:
    def __init__(self, log: list, device: int) -> None:
        self.log, self.device = log, device

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.log, self.device, name)


def _cluster(log: list, use_gpu: bool, n: int = 4):
    def wait(calls, where, deadline_s=None):
        out = []
        for d, ref in calls:
            log.append(("waited", ref[1], d))
            out.append({"t0": 0.0, "t1": 0.0})
        return out

    workers = [_Worker(log, d) for d in range(n)]
    return SimpleNamespace(
        workers=workers, wait=wait, use_gpu=use_gpu,
        migrate_requests=lambda devices: wait([(d, workers[d].migrate_requests.remote()) for d in devices], "m"),
        pacing=DriverPacing(build_config({})), reach=lambda *a: None,
        create_split_groups=lambda a, critical: 0, prewarm=lambda a: [], place_replicas=lambda devices, a=None: None,
        op_entry=lambda name, d, r, critical: {"name": name, "device": d, "critical": critical, "t1": r["t1"]})


def _execute(use_gpu: bool, target_rollout: int):
    log: list = []
    src = Assignment.split(4, 2)
    plan = planner.plan_resize(resize_id=0, step=1, src=src, target_rollout=target_rollout)
    out = ResizeOutcome(plan=plan, t_decide=0.0)
    ctx = resize_ops.ResizeContext(cluster=_cluster(log, use_gpu), plan=plan, version=2, step=1,
                                   background_moments=True, out=out)
    resize_ops.execute(ctx)
    return plan, log, out


def _first(log, kind, name, device):
    return log.index((kind, name, device))


@pytest.mark.parametrize("use_gpu", [False, True])
def test_a_leaver_frees_its_training_memory_before_its_engine_starts_on_gpus_only(use_gpu):
    plan, log, out = _execute(use_gpu, target_rollout=3)
    (leaver,) = plan.moving
    load = _first(log, "queued", "load_weights", leaver)
    moments = _first(log, "queued", "reshard_moments", leaver)
    free = _first(log, "queued", "free_train_memory", leaver)
    critical = {op["name"] for op in out.ops if op["critical"]}
    if use_gpu:
        assert moments < free < load  # the device is free when vLLM measures it
        assert ("waited", "free_train_memory", leaver) in log  # the driver waited: on the critical path
        assert {planner.MOVE_OPTIMIZER_SHARDS, planner.FREE_TRAIN_MEMORY} <= critical
        assert not out.background or all(n == planner.PREWARM_GROUPS for n, _, _ in out.background)
    else:
        assert load < moments < free  # off the critical path, queued after the critical ops
        assert ("waited", "reshard_moments", leaver) not in log
        assert {n for n, _, _ in out.background} == {planner.MOVE_OPTIMIZER_SHARDS, planner.FREE_TRAIN_MEMORY}
        assert not critical & {planner.MOVE_OPTIMIZER_SHARDS, planner.FREE_TRAIN_MEMORY}
    names = [n for k, n, _ in log if (k, n) == ("queued", "reshard_moments")]
    assert len(names) == len(set(plan.src.devices("train")) | set(plan.dst.devices("train")))  # once per device


def test_moments_move_on_every_device_of_a_rollout_to_train_resize_after_its_critical_ops():
    plan, log, out = _execute(True, target_rollout=1)
    (joiner,) = plan.moving
    last_critical = max(i for i, e in enumerate(log) if e[0] == "waited")
    queued = [i for i, e in enumerate(log) if e[:2] == ("queued", "reshard_moments")]
    assert queued and min(queued) > last_critical  # background: after every critical op, not waited for
    assert {d for _, n, d in log if n == "reshard_moments"} == set(plan.src.devices("train")) | {joiner}


def test_pre_warm_skips_held_sets_and_starts_over_in_a_new_world():
    """Sets every worker holds are not pre-warmed again; after a restart (naive resize) or a
    recovery no worker holds any, so all are (before: the bench's optimized resizes after a
    naive restart created their groups on the critical path)."""
    from dynaresize.cluster.cluster import Cluster

    cluster = Cluster(build_config({"cluster": {"devices": 4, "rollout_devices": 2}}))
    log: list = []
    cluster.workers = [_Worker(log, d) for d in range(4)]
    a = Assignment.split(4, 2)
    first = cluster._prewarm(a)
    n_sets = len(cluster._prewarm_sets)
    assert len(first) == 4 and n_sets > 0  # every worker gets the same list
    cluster._known_sets.update((tuple(s), "") for s in cluster._prewarm_sets)
    assert cluster._prewarm(a) == [] and cluster._prewarm_sets == []  # all held: no call at all
    cluster.forget_groups()
    again = cluster._prewarm(a)
    assert len(again) == 4 and len(cluster._prewarm_sets) == n_sets
