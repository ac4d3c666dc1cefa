"""Resize planning: which devices move, and the ops each runs (docs/resize.md).

A plan is a pure value computed the same way by the simulator and the real runtime, whose
executor runs the ops by name. The op names below are the contract between this planner, the
simulator's cost model (`costmodel.costs.op_cost`) and the runtime executor; do not rename them.

Which devices move (deterministic, so every rank computes the same plan):
- growing the rollout pool: the lowest-numbered training devices become rollout devices;
- shrinking it: the highest-numbered rollout devices become training devices.
From the canonical layout (`Assignment.split`: rollout devices first) this keeps both pools
contiguous blocks, so a move of a tensor-parallel unit takes whole, adjacent devices.

Ops per moving device, in order (`Op.after` names the op of the same device that must end
first). Critical ops gate the device's first useful work; background ops overlap real work
(the optimizer shards must arrive before the next optimizer step).

Invariants: every device of `moving` changes role; `dst.num_rollout == target_rollout`; the
ops of a device form one chain of critical ops, then background ops after their prerequisite.
"""

from __future__ import annotations

from dynaresize.types import ROLLOUT, TRAIN, Assignment, Op, ResizePlan

# train -> rollout (a device leaves training)
DROP_FROM_TRAIN_GROUP = "drop_from_train_group"
MOVE_PARAM_SHARDS = "move_param_shards"
LOAD_WEIGHTS = "load_weights"
ALLOC_KV_CACHE = "alloc_kv_cache"
ADD_TO_ROUTER = "add_to_router"
MOVE_OPTIMIZER_SHARDS = "move_optimizer_shards"
FREE_TRAIN_MEMORY = "free_train_memory"
PREWARM_GROUPS = "prewarm_groups"
# rollout -> train (a device joins training)
STOP_ROUTING = "stop_routing"
MIGRATE_REQUESTS = "migrate_requests"
RELEASE_ENGINE_MEMORY = "release_engine_memory"
JOIN_TRAIN_GROUP = "join_train_group"
RECEIVE_PARAM_SHARDS = "receive_param_shards"
RECEIVE_OPTIMIZER_SHARDS = "receive_optimizer_shards"

TO_ROLLOUT_CRITICAL = (DROP_FROM_TRAIN_GROUP, MOVE_PARAM_SHARDS, LOAD_WEIGHTS, ALLOC_KV_CACHE, ADD_TO_ROUTER)
TO_ROLLOUT_BACKGROUND = ((MOVE_OPTIMIZER_SHARDS, DROP_FROM_TRAIN_GROUP), (FREE_TRAIN_MEMORY, MOVE_OPTIMIZER_SHARDS),
                         (PREWARM_GROUPS, ADD_TO_ROUTER))
TO_TRAIN_CRITICAL = (STOP_ROUTING, MIGRATE_REQUESTS, RELEASE_ENGINE_MEMORY, JOIN_TRAIN_GROUP, RECEIVE_PARAM_SHARDS)
TO_TRAIN_BACKGROUND = ((RECEIVE_OPTIMIZER_SHARDS, RECEIVE_PARAM_SHARDS), (PREWARM_GROUPS, RECEIVE_PARAM_SHARDS))
OP_NAMES = frozenset(TO_ROLLOUT_CRITICAL + TO_TRAIN_CRITICAL
                     + tuple(n for n, _ in TO_ROLLOUT_BACKGROUND + TO_TRAIN_BACKGROUND))


def choose_moving(src: Assignment, target_rollout: int) -> tuple[int, ...]:
    """The devices that change role to reach `target_rollout` (see the module rule)."""
    current = src.num_rollout
    if target_rollout > current:
        train = src.devices(TRAIN)
        if target_rollout - current > len(train):
            raise ValueError(f"target rollout {target_rollout} exceeds {src.num_devices} devices")
        return train[: target_rollout - current]
    if target_rollout < current:
        if target_rollout < 0:
            raise ValueError(f"target rollout {target_rollout} < 0")
        rollout = src.devices(ROLLOUT)
        return rollout[target_rollout:]
    return ()


def device_ops(device: int, to_role: str) -> tuple[Op, ...]:
    """The op chain of one moving device."""
    critical, background = ((TO_ROLLOUT_CRITICAL, TO_ROLLOUT_BACKGROUND) if to_role == ROLLOUT
                            else (TO_TRAIN_CRITICAL, TO_TRAIN_BACKGROUND))
    ops = [Op(name=name, device=device, critical=True, after=(critical[i - 1],) if i else ())
           for i, name in enumerate(critical)]
    ops += [Op(name=name, device=device, critical=False, after=(dep,)) for name, dep in background]
    return tuple(ops)


def plan_resize(*, resize_id: int, step: int, src: Assignment, target_rollout: int, reason: str = "") -> ResizePlan:
    """The plan that takes `src` to `target_rollout` rollout devices (before step `step + 1`)."""
    moving = choose_moving(src, target_rollout)
    to_role = ROLLOUT if target_rollout > src.num_rollout else TRAIN
    dst = src.moved(moving, to_role)
    ops = tuple(op for d in moving for op in device_ops(d, to_role))
    return ResizePlan(resize_id=resize_id, step=step, src=src, dst=dst, moving=moving, to_role=to_role,
                      ops=ops, reason=reason)
