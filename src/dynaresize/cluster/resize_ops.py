"""The resize executor: a plan's ops run by name, each through its handler here.

`HANDLERS` maps every op name the planner emits (`control.planner.OP_NAMES`) to the code that
carries it out on the real workers; the simulator's cost table (`costmodel.costs.OP_COSTS`) has
exactly the same names (tests/unit/test_planner.py checks all three agree). `execute` walks the
plan's ops in plan order and runs each distinct name once for all the devices that name it
(the ops of one name are collective: a reshard involves every old and new trainer), so an op
the plan does not name never runs, and a name without a handler stops the resize before
anything moved.

What each op does (train -> rollout, then rollout -> train):
- drop_from_train_group / join_train_group: the new split's communicators (cached when
  pre-warmed: then nothing is created on the critical path);
- move_param_shards / receive_param_shards: the old trainers gather the full weights for the
  devices leaving (their engine's first weights), then every old and new trainer moves its
  parameter (and reference) shards to the new layout through the bounded staging buffer;
- load_weights: a leaving device starts its engine with those weights (a tensor-parallel
  replica's k devices start theirs together, one TP rank each: cluster/replicas.py);
- alloc_kv_cache: the engine reserves its KV cache (bytes in the op record);
- add_to_router / stop_routing: the driver's router (the assignment it dispatches from) starts
  or stops sending requests to the moving devices;
- migrate_requests: the requests still in flight on a leaving rollout device go to the
  remaining replicas (streaming: the router aborts them there and re-queues them with their
  sample ids and seeds, cluster/router.py); the op record counts them (`requests_moved`). At a
  one-step-off boundary none is in flight, and the worker's answer proves it;
- release_engine_memory: the engine is torn down and its memory freed;
- move_optimizer_shards / receive_optimizer_shards: Adam moments to the new layout on the
  background communicator (background ops: queued on every device of the resize ahead of any
  later work, not waited for; with `reshard.background_moments = false` the driver waits for
  them at once, on the critical path);
- free_train_memory: a device that left training returns its training memory (background);
  on GPUs both run before `load_weights`, on the critical path: the engine's start needs the
  device's memory free (`_free_before_start`);
- prewarm_groups: communicators of the splits the policy may pick next (background).

"Background" means not waited for, never another thread: every op runs on the device's one
issuing thread, in the order the driver queued it (cluster/worker.py).

Each handler appends one entry per device it ran on (name, device, epoch t0/t1, bytes) to the
outcome: the runtime turns them into `op` records. With an emulated accelerator
(`cluster.emulate`) each critical op then lasts `costmodel.costs.op_cost` of its name (the driver
waits out the rest) and background ops get their modelled end stamped on their records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dynaresize.control import planner
from dynaresize.types import ROLLOUT, TRAIN, ResizePlan


@dataclass
class ResizeContext:
    """One resize being carried out (see `execute`)."""

    cluster: Any  # cluster.Cluster
    plan: ResizePlan
    version: int
    step: int
    background_moments: bool
    out: Any  # cluster.ResizeOutcome
    ran: set[str] = field(default_factory=set)  # ops already carried out by another op's handler

    def done(self, name: str) -> bool:
        return name in self.ran

    @property
    def old_train(self) -> tuple[int, ...]:
        return self.plan.src.devices(TRAIN)

    @property
    def new_train(self) -> tuple[int, ...]:
        return self.plan.dst.devices(TRAIN)

    @property
    def union(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.old_train) | set(self.new_train)))

    @property
    def moving(self) -> tuple[int, ...]:
        return self.plan.moving

    def call(self, devices, method: str, *args: Any, **kwargs: Any) -> list[dict]:
        """`method` on each device's worker, waited for (with the watchdog)."""
        w = self.cluster.workers
        return self.cluster.wait([(d, getattr(w[d], method).remote(*args, **kwargs)) for d in devices],
                                 f"resize: {method}")

    def record(self, name: str, devices, results, critical: bool = True) -> None:
        for d, r in zip(devices, results):
            self.out.ops.append(self.cluster.op_entry(name, d, r, critical))
            if critical:
                self.out.critical_end = max(self.out.critical_end, r["t1"])

    def background(self, name: str, devices, method: str, *args: Any) -> None:
        """Queue `method` on each device without waiting for it: it runs on the device's
        issuing thread ahead of any later work (cluster/worker.py) and is recorded later
        (emulated: stamped with the op's modelled end, cluster/pacing.py)."""
        w, start, pace_s = self.cluster.workers, time.time(), self.cluster.pacing.op_s(name, self.plan)
        for d in devices:
            self.out.background.append((name, d, getattr(w[d], method).remote(*args)))
            self.out.paced[(name, d)] = (start, pace_s)


def _groups(ctx: ResizeContext) -> None:
    t0 = time.time()
    ctx.out.groups_created_critical += ctx.cluster.create_split_groups(ctx.plan.dst, critical=True)
    name = planner.DROP_FROM_TRAIN_GROUP if ctx.plan.to_role == ROLLOUT else planner.JOIN_TRAIN_GROUP
    ctx.record(name, ctx.moving, [{"t0": t0, "t1": time.time()}] * len(ctx.moving))


def _param_shards(ctx: ResizeContext) -> None:
    c = ctx.cluster
    scalars = ctx.call(ctx.old_train[:1], "trainer_scalars")[0]
    c.reach("resize.reshard", ctx.step, ctx.union)
    gathered: dict[int, dict] = {}
    if ctx.plan.to_role == ROLLOUT:  # the leaving devices' engines start from the full weights
        res = ctx.call(ctx.old_train, "gather_full", ctx.old_train, ctx.moving, ctx.version, ctx.step)
        gathered = dict(zip(ctx.old_train, res))
    res = ctx.call(ctx.union, "reshard_params", ctx.old_train, ctx.new_train, scalars=scalars, step=ctx.step)
    for d, r in zip(ctx.union, res):
        g = gathered.get(d)
        if g is not None:  # one op: the gather, then the reshard
            r = {**r, "t0": g["t0"], "bytes_received": r.get("bytes_received", 0) + g.get("bytes_received", 0)}
        ctx.record(planner.MOVE_PARAM_SHARDS if ctx.plan.to_role == ROLLOUT else planner.RECEIVE_PARAM_SHARDS,
                   [d], [r])


def _load_weights(ctx: ResizeContext) -> None:
    if ctx.cluster.use_gpu and ctx.plan.to_role == ROLLOUT:
        _free_before_start(ctx)
    ctx.cluster.reach("resize.switch", ctx.step, ctx.moving)
    ctx.cluster.place_replicas(ctx.moving, ctx.plan.dst)  # TP replicas: whole ones move (cluster/replicas.py)
    ctx.record(planner.LOAD_WEIGHTS, ctx.moving, ctx.call(ctx.moving, "load_weights", ctx.version, ctx.step))


def _alloc_kv_cache(ctx: ResizeContext) -> None:
    ctx.record(planner.ALLOC_KV_CACHE, ctx.moving, ctx.call(ctx.moving, "alloc_kv_cache"))


def _router(ctx: ResizeContext) -> None:
    """The router dispatches from the cluster's assignment: switching it adds (or removes)
    the moving devices."""
    t0 = time.time()
    ctx.cluster.assignment = ctx.plan.dst
    name = planner.ADD_TO_ROUTER if ctx.plan.to_role == ROLLOUT else planner.STOP_ROUTING
    ctx.record(name, ctx.moving, [{"t0": t0, "t1": time.time()}] * len(ctx.moving))


def _migrate(ctx: ResizeContext) -> None:
    ctx.record(planner.MIGRATE_REQUESTS, ctx.moving, ctx.cluster.migrate_requests(ctx.moving))


def _release_engine(ctx: ResizeContext) -> None:
    ctx.cluster.reach("resize.switch", ctx.step, ctx.moving)
    ctx.record(planner.RELEASE_ENGINE_MEMORY, ctx.moving, ctx.call(ctx.moving, "release_engine", ctx.step))


def _moments(ctx: ResizeContext) -> None:
    if ctx.done(planner.MOVE_OPTIMIZER_SHARDS):
        return
    name = planner.MOVE_OPTIMIZER_SHARDS if ctx.plan.to_role == ROLLOUT else planner.RECEIVE_OPTIMIZER_SHARDS
    if ctx.background_moments:  # queued first on every device of the resize; not waited for
        ctx.background(name, ctx.union, "reshard_moments", ctx.new_train)
    else:  # configured onto the critical path: the driver waits for them now
        ctx.record(name, ctx.union, ctx.call(ctx.union, "reshard_moments", ctx.new_train))


def _free_train_memory(ctx: ResizeContext) -> None:
    if not ctx.done(planner.FREE_TRAIN_MEMORY):
        ctx.background(planner.FREE_TRAIN_MEMORY, ctx.moving, "free_train_memory")


def _free_before_start(ctx: ResizeContext) -> None:
    """On GPUs, a device leaving training must hand its moments on and free the device before
    its engine starts (vLLM checks at start that its share of the memory is free): the two
    background ops run here, on the critical path, waited for (their records say critical)."""
    union, moving = ctx.union, ctx.moving
    ctx.record(planner.MOVE_OPTIMIZER_SHARDS, union, ctx.call(union, "reshard_moments", ctx.new_train))
    ctx.record(planner.FREE_TRAIN_MEMORY, moving, ctx.call(moving, "free_train_memory"))
    ctx.ran |= {planner.MOVE_OPTIMIZER_SHARDS, planner.FREE_TRAIN_MEMORY}


def _prewarm(ctx: ResizeContext) -> None:
    refs = ctx.cluster.prewarm(ctx.plan.dst)
    if refs:
        ctx.out.background += [(planner.PREWARM_GROUPS, d, ref) for d, ref in refs]
    else:  # every worker holds the neighbours' groups already: the op ran and had nothing to create
        t = time.time()
        ctx.record(planner.PREWARM_GROUPS, ctx.moving, [{"t0": t, "t1": t}] * len(ctx.moving), critical=False)


HANDLERS: dict[str, Callable[[ResizeContext], None]] = {
    planner.DROP_FROM_TRAIN_GROUP: _groups,
    planner.JOIN_TRAIN_GROUP: _groups,
    planner.MOVE_PARAM_SHARDS: _param_shards,
    planner.RECEIVE_PARAM_SHARDS: _param_shards,
    planner.LOAD_WEIGHTS: _load_weights,
    planner.ALLOC_KV_CACHE: _alloc_kv_cache,
    planner.ADD_TO_ROUTER: _router,
    planner.STOP_ROUTING: _router,
    planner.MIGRATE_REQUESTS: _migrate,
    planner.RELEASE_ENGINE_MEMORY: _release_engine,
    planner.MOVE_OPTIMIZER_SHARDS: _moments,
    planner.RECEIVE_OPTIMIZER_SHARDS: _moments,
    planner.FREE_TRAIN_MEMORY: _free_train_memory,
    planner.PREWARM_GROUPS: _prewarm,
}


def op_order(plan: ResizePlan) -> list[str]:
    """The distinct op names of `plan`: critical ones in chain order, then background ones."""
    names: list[str] = []
    for critical in (True, False):
        for op in plan.ops:
            if op.critical == critical and op.name not in names:
                names.append(op.name)
    return names


def execute(ctx: ResizeContext) -> None:
    """Run `ctx.plan`'s ops by name (critical ones waited for, background ones started)."""
    names = op_order(ctx.plan)
    missing = [n for n in names if n not in HANDLERS]
    if missing:
        raise ValueError(f"resize plan {ctx.plan.resize_id}: no handler for ops {missing}")
    critical = {op.name for op in ctx.plan.ops if op.critical}
    for name in names:
        start, first = time.time(), len(ctx.out.ops)
        HANDLERS[name](ctx)
        if name in critical:  # emulated: the op lasts its modelled cost (cluster/pacing.py)
            ctx.cluster.pacing.after_op(name, start, ctx.out, ctx.plan, first)
