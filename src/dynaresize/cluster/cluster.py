"""The driver's handle on the device workers: start, route work, sync weights, carry out resizes.

One `Cluster` per run. It starts (or joins) Ray, reserves one placement-group bundle per device,
creates one `DeviceWorker` per device, joins them into one torch.distributed world once, and
creates the communicators the first split needs plus a `background` group over all devices.

Invariants kept here, for the whole run:
- Group creation is driven from this one place, in one order, on every worker (the
  `CommPool` invariant): `_create_groups` and `_prewarm` are the only callers.
- A resize never initialises a world; `comm_stats()["world_inits"]` stays 1 on every worker.
- Resize ops are run by name from the plan (control.planner op names); each returns device
  epoch times that become `op` records (seconds since the run start).

The stages of a step (rollout, training, weight sync) are `cluster/stages.py`.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from dynaresize.cluster import placement, replicas
from dynaresize.cluster.faults import FaultInjector, parse_faults
from dynaresize.cluster.pacing import DriverPacing
from dynaresize.cluster.placement import actor_options, make_placement_group, release_placement_group, worker_env
from dynaresize.cluster.stages import StagesMixin
from dynaresize.cluster.watchdog import DevicesLost, Watchdog
from dynaresize.cluster.worker import remote_worker_class, worker_config
from dynaresize.cluster.worker_resize import BACKGROUND_TAG
from dynaresize.comm import rendezvous
from dynaresize.comm.pool import rank_sets_for_split
from dynaresize.config import RunConfig
from dynaresize.control import planner
from dynaresize.emulate.model import run_bounds
from dynaresize.errors import ConfigError
from dynaresize.types import ROLLOUT, TRAIN, Assignment, ResizePlan

PREWARM_ALL_SPLITS = 8  # up to this many legal splits, pre-warm the groups of all of them


@dataclass
class ResizeOutcome:
    plan: ResizePlan
    t_decide: float
    ops: list[dict] = field(default_factory=list)  # name, device, t0, t1, bytes, critical
    background: list[tuple[str, int, Any]] = field(default_factory=list)  # (name, device, ObjectRef)
    paced: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # emulated: (start, pace_s)
    groups_created_critical: int = 0
    critical_end: float = 0.0


class Cluster(StagesMixin):
    """Ray workers for one run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, on_event: Callable[[str, dict], None] | None = None) -> None:
        self.cfg = cfg
        self.num_devices = cfg.cluster.devices
        self.on_event = on_event or (lambda kind, fields: None)
        self.workers: list[Any] = []
        self._pg = None
        self._started_ray = False
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dynaresize-driver")
        self.assignment: Assignment | None = None
        self.bounds = run_bounds(cfg)  # the policy's limits (raised to an emulated accelerator's)
        self.pacing = DriverPacing(cfg)  # emulated accelerators: what each call is paced to (pacing.py)
        # Faults (docs/faults.md): ranks are renumbered 0..M-1 after a loss; `ids[rank]` is the
        # device id of the first generation, the one records use. Every wait has a deadline.
        self.ids: list[int] = list(range(self.num_devices))
        self.nodes: list[str] = []  # Ray node id by device id, set at start (`_place`)
        self.node_addresses: dict[str, tuple[str, int]] = {}
        self.generation = 0
        self.migrator: Callable[[Any], list[dict]] | None = None  # streaming: the router's (migrate_requests)
        self.faults = FaultInjector(parse_faults(cfg.faults, self.num_devices))
        self.use_gpu = False  # set by start: NCCL on GPUs
        self._shapes: list | None = None  # trainable parameter shapes (layout_for)
        # Streaming (train.staleness >= 2): engines run requests across resizes, and Ray runs a
        # worker's calls one at a time, so a split whose groups every worker already holds
        # (created or pre-warmed, and waited for) is switched to without calling every worker.
        self.skip_known_groups = cfg.train.staleness >= 2
        self._known_sets: set[tuple] = set()
        self._prewarm_sets: list[tuple[int, ...]] = []
        self.watchdog = Watchdog(ping=lambda r: self.workers[r].alive.remote(), collective_s=cfg.timeouts.collective_s,
                                 call_s=cfg.timeouts.actor_call_s,  # a loss aborts the batch's survivors' comms
                                 on_loss=lambda ranks: [self.workers[r].abort_comms.remote() for r in ranks])

    # ------------------------------------------------------------------ life cycle

    def start(self, assignment: Assignment) -> None:
        cfg = self.cfg
        if not ray.is_initialized():
            need = math.ceil(self.num_devices * cfg.cluster.cpus_per_device)
            # a Ray of our own (address=local) where none is given, even where another runs on this machine;
            # the job's cluster under `ray job submit` (RAY_ADDRESS): placement.init_kwargs
            ray.init(**placement.init_kwargs(cfg.cluster.address, max(os.cpu_count() or 1, need)))
            self._started_ray = True
        self.use_gpu = use_gpu = placement.gpus_wanted(cfg.cluster.backend, ray.cluster_resources())
        self._pg = make_placement_group(self.num_devices, use_gpu=use_gpu, cpus_per_device=cfg.cluster.cpus_per_device,
                                        strategy=cfg.cluster.placement_strategy)
        actor_cls = remote_worker_class()
        cfg_dict = worker_config(cfg)
        env = worker_env(cfg.cluster.torch_threads)
        self.workers = [actor_cls.options(**actor_options(self._pg, d, use_gpu=use_gpu,
                                                           cpus_per_device=cfg.cluster.cpus_per_device), **env)
                        .remote(d, cfg_dict) for d in range(self.num_devices)]
        self._place()  # nodes by device id, the `placement` record, node faults (docs/cluster.md)
        self._check_replica_nodes()
        armed = self.faults.arm(self.worker_of)
        self.wait([(self.ids.index(a.spec.device), ref) for a, ref in zip(self.faults.faults, armed)], "arm faults")
        port = self.wait([(0, self.workers[0].free_port.remote())], "start")[0]
        info = self.wait([(0, self.workers[0].info.remote())], "start")[0]
        ip, self.cuda = info["ip"], info["torch_device"].startswith("cuda")  # the workers' device, not the driver's
        init_method = rendezvous.world_init_method(ip, port)
        inits = self.wait([(d, w.init_world.remote(init_method, self.num_devices)) for d, w in enumerate(self.workers)],
                          "world init")
        for d, r in enumerate(inits):
            self.on_event("comm", {"event": "world_init", "ranks": list(range(self.num_devices)), "critical": False,
                                   "device": d, "seconds": r["t1"] - r["t0"]})
        self.assignment = assignment
        # The background group (all devices) carries optimizer moments while the main thread computes.
        self._create_groups([tuple(range(self.num_devices))], critical=False, tag=BACKGROUND_TAG)
        self._create_groups(self._split_sets(assignment), critical=False)
        train, rollout = assignment.devices(TRAIN), assignment.devices(ROLLOUT)
        self.place_replicas(rollout)
        self.wait([(d, self.workers[d].start_train.remote(train)) for d in train]
                  + [(d, self.workers[d].start_rollout.remote(0)) for d in rollout], "start roles")
        self._prewarm_futures = self._prewarm(assignment)

    def _place(self) -> None:
        """Where each device landed: `nodes[device id]` (Ray node ids), recorded once."""
        self.nodes = placement.bundle_nodes(self._pg)
        self.node_addresses = placement.node_addresses()  # raylets, to tell a lost node from a lost process
        names = placement.node_names()
        self.faults.set_nodes(self.nodes, driver_node=ray.get_runtime_context().get_node_id())
        self.on_event("placement", {"strategy": self.cfg.cluster.placement_strategy, "nodes": self.nodes,
                                    "node_names": [names.get(n, n) for n in self.nodes],
                                    "num_nodes": len(set(self.nodes))})

    def _check_replica_nodes(self) -> None:
        """Every split the bounds allow keeps each TP replica on one node (the rollout pool is
        the first ranks), so no move finds out half-way: a config error before anything starts."""
        k = self.cfg.rollout.tensor_parallel
        for r in (self.bounds.splits() if k > 1 else ()):
            try:
                replicas.replicas_of(range(r), k, self.node_of)
            except RuntimeError as exc:
                raise ConfigError([f"rollout.tensor_parallel={k}: with {r} rollout devices {exc}"]) from None

    def node_of(self, rank: int) -> str:
        """The Ray node id of the worker at world rank `rank` (this generation)."""
        return self.nodes[self.ids[rank]]

    def replicas(self, assignment: Assignment | None = None) -> list[replicas.Replica]:
        """The rollout replicas of `assignment` (the current one): `rollout.tensor_parallel`
        consecutive rollout ranks each, on one node (cluster/replicas.py)."""
        a = assignment or self.assignment
        return replicas.replicas_of(a.devices(ROLLOUT), self.cfg.rollout.tensor_parallel, self.node_of)

    def place_replicas(self, devices, assignment: Assignment | None = None) -> None:
        """Form the replicas of `assignment` that hold any of `devices`: their ranks learn their TP
        rank and a fresh rendezvous (queued ahead of the calls that start their engines)."""
        want = set(devices)
        reps = [rep for rep in self.replicas(assignment) if want & set(rep)]
        placed = replicas.place(self.workers, reps,
                                lambda d: self.node_addresses.get(self.node_of(d), ("127.0.0.1", 0))[0],
                                lambda d: self.wait([(d, self.workers[d].rendezvous_port.remote())], "port")[0])
        if placed:
            self.wait(placed, "form rollout replicas")

    def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already dead (a lost device): nothing to end
                pass
        self.workers = []
        if self._pg is not None:
            try:
                release_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ communicators

    def _split_sets(self, a: Assignment) -> tuple[tuple[int, ...], ...]:
        return rank_sets_for_split(a.devices(TRAIN), a.devices(ROLLOUT))

    def _create_groups(self, rank_sets, *, critical: bool, tag: str = "") -> int:
        out = self.wait([(d, w.create_groups.remote(list(rank_sets), critical, tag)) for d, w in enumerate(self.workers)],
                        "create groups")
        for rs, made in zip(rank_sets, out[0]["flags"]):
            self.on_event("comm", {"event": "group_create" if made else "group_reuse", "ranks": list(rs),
                                   "critical": critical, "tag": tag})
        self._known_sets.update((tuple(rs), tag) for rs in rank_sets)
        return out[0]["created"]

    def _neighbour_sets(self, a: Assignment) -> list[tuple[int, ...]]:
        """Rank sets of the splits the policy may pick next: every legal split when there are
        few (a small cluster), else those within two move units of the current one."""
        splits = self.bounds.splits()
        if len(splits) > PREWARM_ALL_SPLITS:
            unit = self.bounds.move_unit
            splits = tuple(r for r in splits if 0 < abs(r - a.num_rollout) <= 2 * unit)
        sets: list[tuple[int, ...]] = []
        for target in splits:
            if target != a.num_rollout:
                dst = planner.plan_resize(resize_id=-1, step=-1, src=a, target_rollout=target).dst
                sets.extend(s for s in self._split_sets(dst) if s not in sets)
        return sets

    def _prewarm(self, a: Assignment) -> list[Any]:
        """Queue the creation of the neighbouring splits' groups on every worker (not waited
        for), and the destruction of every group outside split `a`'s, its neighbours' and the
        background one (`CommPool.retain`: the pool stays bounded however many moves a run
        makes; every use of a destroyed group was queued earlier). Sets every worker already
        holds are left out, so once they are all made and none is stale no call is queued at
        all (a call behind a busy engine would hold every other device at it)."""
        neighbours = self._neighbour_sets(a)
        keep = {(tuple(range(self.num_devices)), BACKGROUND_TAG)}
        keep |= {(tuple(s), "") for s in (*self._split_sets(a), *neighbours)}
        sets = [s for s in neighbours if (tuple(s), "") not in self._known_sets]
        stale = sorted(self._known_sets - keep)
        self._prewarm_sets = list(sets)
        if not sets and not stale:
            return []
        for rs, tag in stale:
            self.on_event("comm", {"event": "group_destroy", "ranks": list(rs), "critical": False, "tag": tag})
        self._known_sets -= set(stale)
        keep_arg = [(tag, list(rs)) for rs, tag in sorted(keep)]
        return [w.prewarm_groups.remote(sets, keep_arg) for w in self.workers]

    def forget_groups(self) -> None:
        """The world is new (a naive restart, a recovery): no worker holds any group yet, and
        pre-warms in flight belonged to the old one."""
        self._known_sets.clear()
        self._prewarm_futures, self._prewarm_sets = [], []

    def wait_prewarm(self) -> int:
        futures, self._prewarm_futures = self._prewarm_futures, []
        out = self.wait(list(enumerate(futures)), "pre-warm groups") if futures else []
        if futures:
            self._known_sets.update((tuple(rs), "") for rs in self._prewarm_sets)
        return out[0]["created"] if out else 0

    def comm_stats(self) -> list[dict]:
        return self.wait([(d, w.comm_stats.remote()) for d, w in enumerate(self.workers)], "comm stats")

    # ------------------------------------------------------------------ waiting and faults

    def wait(self, calls: list[tuple[int, Any]], where: str, deadline_s: float | None = None) -> list[Any]:
        """Results of (rank, ref) calls; `DevicesLost` when a device was lost (cluster/watchdog.py)."""
        return self.watchdog.wait(calls, where, deadline_s=deadline_s)

    def raise_if_lost(self, where: str) -> None:
        if self.watchdog.lost:
            raise DevicesLost(dict(self.watchdog.lost), where)

    def worker_of(self, device_id: int) -> Any:
        return self.workers[self.ids.index(device_id)]

    def reach(self, point: str, step: int, ranks) -> None:
        """The run reached fault point `point` of `step`, carried out by `ranks` (cluster/faults.py)."""
        alive = lambda dev: dev in self.ids and self.ids.index(dev) not in self.watchdog.lost  # noqa: E731
        self.faults.reach(point, step, [self.ids[r] for r in ranks], self.worker_of, alive)

    # ------------------------------------------------------------------ resize

    def resize(self, plan: ResizePlan, *, version: int, step: int, background_moments: bool) -> ResizeOutcome:
        """Carry out the critical ops of `plan` now, by name (cluster/resize_ops.py); start its
        background ops and return."""
        from dynaresize.cluster import resize_ops

        out = ResizeOutcome(plan=plan, t_decide=time.time())
        self.wait_prewarm()  # pre-warm runs in the background; never two group creations at once
        resize_ops.execute(resize_ops.ResizeContext(cluster=self, plan=plan, version=version, step=step,
                                                    background_moments=background_moments, out=out))
        self.assignment = plan.dst
        return out

    def create_split_groups(self, a: Assignment, *, critical: bool) -> int:
        """The communicators split `a` needs (created now unless cached); how many were created."""
        sets = self._split_sets(a)
        if self.skip_known_groups and all((tuple(rs), "") in self._known_sets for rs in sets):
            for rs in sets:  # every worker holds them: no call (streaming engines stay busy)
                self.on_event("comm", {"event": "group_reuse", "ranks": list(rs), "critical": critical, "tag": ""})
            return 0
        return self._create_groups(sets, critical=critical)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """`fn` on a driver thread (the streaming router's pump while training runs)."""
        return self._executor.submit(fn, *args, **kwargs)

    def prewarm(self, a: Assignment) -> list[tuple[int, Any]]:
        """Start pre-warming the groups of the splits near `a`; (device, ref) per worker."""
        self._prewarm_futures = self._prewarm(a)
        return list(enumerate(self._prewarm_futures))

    def finish_background(self, outcome: ResizeOutcome) -> None:
        """Wait for a resize's background ops and add them to its op list."""
        background, outcome.background = outcome.background, []
        results = self.wait([(d, ref) for _, d, ref in background], "resize: background ops")
        for (name, d, _), r in zip(background, results):
            r = self.pacing.stamp(r, *outcome.paced.get((name, d), (0.0, None)))  # emulated: the op's modelled end
            outcome.ops.append(self.op_entry(name, d, r, False))
        if any(name == planner.PREWARM_GROUPS for name, _, _ in background):
            self._known_sets.update((tuple(rs), "") for rs in self._prewarm_sets)
        self._prewarm_futures = []

    def migrate_requests(self, devices) -> list[dict]:
        """The `migrate_requests` op: the requests in flight on leaving rollout devices go to the
        remaining replicas. Under streaming the router does it (`migrator`, set by
        driver/streaming.py); otherwise nothing is in flight at a step boundary and each worker's
        answer says how many its engine still held (0)."""
        if self.migrator is not None:
            return self.migrator(devices)
        return self.wait([(d, self.workers[d].migrate_requests.remote()) for d in devices], "resize: migrate_requests")

    def op_entry(self, name: str, d: int, r: dict, critical: bool) -> dict:
        """One op's entry: times, bytes received and the staging it held (reshard ops)."""
        return {"name": name, "device": self.ids[d], "t0": r["t0"], "t1": r["t1"],
                "bytes": int(r.get("bytes_received", 0)), "critical": critical,
                **{k: r[k] for k in ("peak_staging_bytes", "bytes_sent", "num_messages", "kv_cache_bytes",
                                                      "requests_moved") if k in r}}

    # ------------------------------------------------------------------ outputs

    def on_trainers(self, method: str, *args: Any, where: str) -> Any:
        """A collective method on every trainer; the first trainer's result."""
        train = self.assignment.devices(TRAIN)
        return self.wait([(d, getattr(self.workers[d], method).remote(*args)) for d in train], where)[0]

    def param_digest(self) -> str:
        """sha1 of the current full weights (collective over the trainers; deterministic mode)."""
        return self.on_trainers("param_digest", where="digest")

    def layout_for(self, ranks) -> Any:
        """The trainers' state layout over `ranks` (the backend's: FSDP2 row chunks)."""
        from dynaresize.reshard.layout import RowChunkLayout
        from dynaresize.roles.lora_model import trainable_specs

        if self._shapes is None:  # LoRA: the adapter's
            self._shapes = [s for _, s in trainable_specs(self.cfg.model, self.cfg.train.lora)]
        return RowChunkLayout.of_shapes(self._shapes, tuple(ranks))

    def check_engine_weights(self, digest: str, version: int) -> None:
        """Deterministic mode: every rollout engine serves exactly the trainers' weights."""
        rollout = self.assignment.devices(ROLLOUT)
        got = self.wait([(d, self.workers[d].engine_digest.remote()) for d in rollout], "engine digest")
        bad = [self.ids[d] for d, g in zip(rollout, got) if g != digest]
        if bad:
            raise RuntimeError(f"weight sync of version {version}: engines on devices {bad} do not hold the "
                               "trainers' weights (digest mismatch)")

    def full_weights(self) -> dict:
        """The current full fp32 weights on the driver, by parameter name (tied weights once)."""
        return self.on_trainers("full_weights", where="export")

    def save_checkpoint(self, directory: str, extra: dict | None = None) -> None:
        """A trainer checkpoint of the current state (each trainer writes its shard: cluster/checkpoint_io.py)."""
        from dynaresize.cluster.checkpoint_io import write_trainer_checkpoint

        scalars = self.wait([(self.assignment.devices(TRAIN)[0], self.workers[self.assignment.devices(TRAIN)[0]]
                              .trainer_scalars.remote())], "checkpoint")[0]
        write_trainer_checkpoint(self, directory, version=scalars["step"], extra=extra)  # each trainer its shard
