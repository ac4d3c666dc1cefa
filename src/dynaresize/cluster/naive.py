"""The naive resize baseline: what elastic training does today, built from the same real parts.

A naive resize restarts everything: the trainers write their state to a checkpoint on disk,
every worker process is torn down (`ray.kill`), new workers are created (new processes, in the
same placement-group bundles), they join a new world (new port), create the communicators of
the new split, the new training devices reload trainer state from the checkpoint at the new
training world size (`FSDPTrainer.load_checkpoint` reshards on load), and the rollout
engines are rebuilt and given the current weights. Nothing useful can run until all of that
is done, so its whole length is critical: `critical_s` = decision to the last phase's end.

Invariants:
- It uses the product's parts (DeviceWorker actor, placement, rendezvous, CommPool, checkpoint
  files), so the comparison with `Cluster.resize` measures the method, not two code bases.
- Afterwards the `Cluster` is in the same state an optimized resize would leave it in (new
  workers, `assignment == plan.dst`, the background group and neighbouring splits' groups
  created off the critical path), so a run may continue with either kind of resize.
- Every phase is timed by the driver (epoch seconds, `time.time()`), and per device where the
  work is per device; `phases` is what the bench reports.

Pending optimizer moments (a previous optimized resize not finished) must be waited for
before a naive resize: a checkpoint of pending state is refused by the trainer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dynaresize.cluster.checkpoint_io import dir_bytes
from dynaresize.cluster.cluster import Cluster
from dynaresize.cluster.placement import actor_options, worker_env
from dynaresize.cluster.worker import remote_worker_class, worker_config
from dynaresize.cluster.worker_resize import BACKGROUND_TAG
from dynaresize.comm import rendezvous
from dynaresize.config import RunConfig
from dynaresize.types import ROLLOUT, TRAIN, ResizePlan

# Phase names, in the order they run (LOAD_CHECKPOINT on training devices and BUILD_ENGINES on
# rollout devices run side by side).
SAVE_CHECKPOINT = "save_checkpoint"
TEARDOWN = "teardown_workers"
SPAWN = "spawn_workers"
INIT_WORLD = "init_world"
CREATE_GROUPS = "create_groups"
LOAD_CHECKPOINT = "load_checkpoint"
BUILD_ENGINES = "build_rollout_engines"
LOAD_WEIGHTS = "load_weights"
PHASES = (SAVE_CHECKPOINT, TEARDOWN, SPAWN, INIT_WORLD, CREATE_GROUPS, LOAD_CHECKPOINT, BUILD_ENGINES, LOAD_WEIGHTS)


@dataclass
class NaiveOutcome:
    """What one naive resize did, phase by phase (epoch seconds)."""

    plan: ResizePlan
    t_decide: float
    phases: list[dict] = field(default_factory=list)  # name, t0, t1, device (-1: all), bytes
    critical_end: float = 0.0
    groups_created_critical: int = 0
    checkpoint_bytes: int = 0
    old_pids: list[int] = field(default_factory=list)
    new_pids: list[int] = field(default_factory=list)
    checkpoint_dir: str | None = None  # set when the checkpoint was kept

    @property
    def critical_s(self) -> float:
        return self.critical_end - self.t_decide

    def phase_s(self) -> dict[str, float]:
        """Seconds per phase: from its first start to its last end over devices."""
        spans: dict[str, list[float]] = {}
        for p in self.phases:
            lo_hi = spans.setdefault(p["name"], [p["t0"], p["t1"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], p["t0"]), max(lo_hi[1], p["t1"])
        return {name: hi - lo for name, (lo, hi) in spans.items()}


def _wait_dead(workers: list[Any], timeout_s: float) -> None:
    """Return once every killed actor refuses calls (its process is gone or going)."""
    deadline = time.time() + timeout_s
    for w in workers:
        while True:
            try:
                ray.get(w.ping.remote(), timeout=max(0.1, deadline - time.time()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            if time.time() > deadline:
                raise RuntimeError(f"naive resize: a killed worker still answers after {timeout_s:g}s")
            time.sleep(0.01)  # ray.kill is asynchronous; poll until the actor is marked dead


def naive_resize(cluster: Cluster, plan: ResizePlan, *, version: int, step: int,
                 checkpoint_root: str | os.PathLike | None = None, new_cfg: RunConfig | None = None,
                 keep_checkpoint: bool = False) -> NaiveOutcome:
    """Carry out `plan` by a full restart (module docstring); returns its timed phases.

    `new_cfg` (default: the cluster's) configures the new workers, as a restarted job may pick
    up a new configuration. The checkpoint goes to a fresh directory under `checkpoint_root`
    (default: the system temp dir) and is deleted afterwards unless `keep_checkpoint`.
    """
    if cluster.assignment != plan.src:
        raise ValueError(f"plan starts from {plan.src.to_json()}, the cluster is at {cluster.assignment.to_json()}")
    t_decide = time.time()
    out = NaiveOutcome(plan=plan, t_decide=t_decide)
    cluster.wait_prewarm()  # never kill a worker in the middle of a group creation it started

    def phase(name: str, t0: float, t1: float, device: int = -1, nbytes: int = 0) -> None:
        out.phases.append({"name": name, "t0": t0, "t1": t1, "device": device, "bytes": int(nbytes)})
        out.critical_end = max(out.critical_end, t1)

    ckpt_dir = Path(tempfile.mkdtemp(prefix=f"naive-resize-{plan.resize_id}-", dir=checkpoint_root))
    try:
        # 1. Trainer state to disk (every old training device writes its shard; collective).
        t0 = time.time()
        cluster.save_checkpoint(str(ckpt_dir), extra={"version": version, "step": step})
        out.checkpoint_bytes = dir_bytes(ckpt_dir)
        phase(SAVE_CHECKPOINT, t0, time.time(), nbytes=out.checkpoint_bytes)

        # 2. Tear down every worker process.
        t0 = time.time()
        old = list(cluster.workers)
        out.old_pids = [int(i["pid"]) for i in ray.get([w.info.remote() for w in old])]
        for w in old:
            ray.kill(w, no_restart=True)
        _wait_dead(old, cluster.cfg.timeouts.actor_call_s)
        cluster.workers = []
        cluster.forget_groups()  # new processes, a new world: nothing is cached, nothing in flight
        phase(TEARDOWN, t0, time.time())

        # 3. New worker processes in the same bundles (process start, imports, config).
        cfg = new_cfg or cluster.cfg
        cluster.cfg = cfg
        t0 = time.time()
        use_gpu = cluster.use_gpu  # the bundles' (placement.gpus_wanted, decided at the cluster's start)
        actor_cls = remote_worker_class()
        cfg_dict = worker_config(cfg)
        workers = [actor_cls.options(**actor_options(cluster._pg, d, use_gpu=use_gpu,
                                                     cpus_per_device=cfg.cluster.cpus_per_device),
                                     **worker_env(cfg.cluster.torch_threads)).remote(d, cfg_dict)
                   for d in range(cluster.num_devices)]
        infos = ray.get([w.info.remote() for w in workers])
        out.new_pids = [int(i["pid"]) for i in infos]
        phase(SPAWN, t0, time.time())

        # 4. A new world on a new port.
        t0 = time.time()
        port = ray.get(workers[0].free_port.remote())
        init_method = rendezvous.world_init_method(infos[0]["ip"], port)
        inits = ray.get([w.init_world.remote(init_method, cluster.num_devices) for w in workers])
        cluster.workers = workers
        for d in range(cluster.num_devices):
            cluster.on_event("comm", {"event": "world_init", "ranks": list(range(cluster.num_devices)),
                                      "critical": True, "device": d, "seconds": inits[d]["t1"] - inits[d]["t0"]})
        phase(INIT_WORLD, t0, time.time())

        # 5. The new split's communicators, all created on the critical path.
        t0 = time.time()
        out.groups_created_critical = cluster._create_groups(cluster._split_sets(plan.dst), critical=True)
        phase(CREATE_GROUPS, t0, time.time())

        # 6. Reload trainer state at the new training world size; rebuild rollout engines, side by side.
        train, rollout = plan.dst.devices(TRAIN), plan.dst.devices(ROLLOUT)
        t0 = time.time()
        cluster.place_replicas(rollout, plan.dst)  # TP replicas: each rank learns its peers first
        pending = {workers[d].load_checkpoint.remote(str(ckpt_dir), train): (LOAD_CHECKPOINT, d) for d in train}
        pending.update({workers[d].start_rollout.remote(version): (BUILD_ENGINES, d) for d in rollout})
        while pending:  # per-device ends as the driver sees them (the calls return no times)
            done, _ = ray.wait(list(pending), num_returns=1)
            ray.get(done[0])
            name, d = pending.pop(done[0])
            phase(name, t0, time.time(), device=d)

        # 7. The rebuilt engines get the current weights (the regular weight sync).
        cluster.assignment = plan.dst
        t0 = time.time()
        synced = cluster.sync_weights(version, step)
        phase(LOAD_WEIGHTS, t0, time.time(), nbytes=max((int(s["bytes"]) for s in synced), default=0))
    finally:
        if keep_checkpoint:
            out.checkpoint_dir = str(ckpt_dir)
        else:
            shutil.rmtree(ckpt_dir, ignore_errors=True)

    # Off the critical path: what the optimized runtime also keeps (background group,
    # neighbouring splits), so the cluster may go on with either kind of resize.
    cluster._create_groups([tuple(range(cluster.num_devices))], critical=False, tag=BACKGROUND_TAG)
    cluster._prewarm_futures = cluster._prewarm(plan.dst)
    return out
