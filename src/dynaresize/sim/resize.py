"""Timing of a resize plan from the op cost model, and of intra-step lending.

A plan's ops run per moving device as a chain (`Op.after`); moving devices run in parallel.
The critical path ends when the last critical op of any device ends: the next step starts
then. Background ops overlap the next step; the optimizer-shard ops must end before that
step's optimizer step, so when they end later than the training stage would, training waits
(`optimizer_ready_s`).

Lending (the `lend` baseline, REFERENCES 4: verl's hybrid replicas): when the training stage
ends before the rollout stage, trainers offload their training state, wake a rollout engine and
take a share of the remaining rollout work; they hand it back and reload their state before
the next training stage. The model is deliberately generous to lending: the movable remaining
work spreads evenly over all replicas (free migration beyond a re-prefill charge), limited only
by each replica's serial remainder (its longest running response's own decode pace), and the lender lends only when that is
predicted to end the step sooner (perfect foresight).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dynaresize.control.planner import MOVE_OPTIMIZER_SHARDS, RECEIVE_OPTIMIZER_SHARDS, plan_resize
from dynaresize.sim.costs import Hardware, ModelPreset, op_cost
from dynaresize.types import ROLLOUT, Assignment, ResizePlan

MIGRATE_S = 1.0  # re-prefill of migrated requests (REFERENCES 3.4: RollPacker migration <= 3 s)


@dataclass(frozen=True, kw_only=True)
class OpTime:
    name: str
    device: int
    critical: bool
    start_s: float  # from the start of the resize
    end_s: float
    bytes: float


@dataclass(frozen=True, kw_only=True)
class ResizeTiming:
    critical_s: float
    total_s: float
    optimizer_ready_s: float  # when the optimizer shards are in place (from the resize start)
    ops: tuple[OpTime, ...]
    bytes_moved: float


def time_plan(plan: ResizePlan, model: ModelPreset, hw: Hardware = Hardware()) -> ResizeTiming:
    n_before, n_after = plan.src.num_train, plan.dst.num_train
    ends: dict[tuple[int, str], float] = {}
    out: list[OpTime] = []
    for op in plan.ops:  # the planner emits each device's ops in dependency order
        start = max((ends[(op.device, a)] for a in op.after), default=0.0)
        dur, nbytes = op_cost(op.name, model, num_train_before=n_before, num_train_after=n_after,
                              num_moving=len(plan.moving), hw=hw)
        ends[(op.device, op.name)] = start + dur
        out.append(OpTime(name=op.name, device=op.device, critical=op.critical, start_s=start,
                          end_s=start + dur, bytes=nbytes))
    crit = max((o.end_s for o in out if o.critical), default=0.0)
    total = max((o.end_s for o in out), default=0.0)
    opt = max((o.end_s for o in out if o.name in (MOVE_OPTIMIZER_SHARDS, RECEIVE_OPTIMIZER_SHARDS)), default=0.0)
    return ResizeTiming(critical_s=crit, total_s=total, optimizer_ready_s=opt, ops=tuple(out),
                        bytes_moved=sum(o.bytes for o in out))


@lru_cache(maxsize=65536)
def canonical_timing(model: ModelPreset, num_devices: int, src_rollout: int, dst_rollout: int) -> ResizeTiming:
    """Timing of the plan from the canonical split `src_rollout` to `dst_rollout` (the planner
    keeps canonical layouts canonical, so this is what the engine pays)."""
    plan = plan_resize(resize_id=0, step=0, src=Assignment.split(num_devices, src_rollout), target_rollout=dst_rollout)
    return time_plan(plan, model)


@dataclass(frozen=True, kw_only=True)
class LendOutcome:
    lent: bool
    rollout_s: float  # when the last response ends
    back_s: float  # when the lenders are trainers again (>= rollout_s when lent)
    lender_devices: int
    lender_busy_device_s: float  # lenders' rollout work + their two switches
    switch_in_s: float
    switch_out_s: float


def lend_switch_s(model: ModelPreset, num_train: int, hw: Hardware = Hardware()) -> tuple[float, float]:
    """(in, out) seconds of a trainer turning into a rollout replica and back: offload / reload its
    share of the training state over PCIe (REFERENCES 5) and wake / release an engine (3.3)."""
    share = model.train_state_bytes / max(num_train, 1)
    switch_in = share / hw.pcie_d2h_bw + model.engine_wake_s + model.kv_alloc_s
    switch_out = model.engine_release_s + share / hw.pcie_h2d_bw
    return switch_in, switch_out


def lend_step(replica_times: np.ndarray, replica_serial_s: np.ndarray, train_s: float, num_train: int,
              model: ModelPreset, hw: Hardware = Hardware()) -> LendOutcome:
    """One step of lending, given the rollout replicas' finish times without lenders and the
    serial part of each (its decode steps' weight reads: the longest running request's own
    pace, which no other replica can take over)."""
    t_roll = float(replica_times.max())
    tp = model.rollout_tp
    lender_reps = num_train // tp
    switch_in, switch_out = lend_switch_s(model, num_train, hw)
    none = LendOutcome(lent=False, rollout_s=t_roll, back_s=t_roll, lender_devices=0, lender_busy_device_s=0.0,
                       switch_in_s=switch_in, switch_out_s=switch_out)
    t_avail = train_s + switch_in
    if lender_reps == 0 or t_avail >= t_roll:
        return none
    left = np.maximum(replica_times - t_avail, 0.0)
    # Progress is taken as linear in time: the serial share of what is left stays on the replica.
    serial_left = left * np.where(replica_times > 0, replica_serial_s / np.maximum(replica_times, 1e-12), 0.0)
    movable = float((left - serial_left).sum())
    fluid_end = t_avail + MIGRATE_S + movable / (replica_times.size + lender_reps)
    end = max(fluid_end, t_avail + float(serial_left.max()))
    if end + switch_out >= t_roll:  # lending would not end the step sooner
        return none
    lender_work = max(end - t_avail, 0.0) * lender_reps * tp
    return LendOutcome(lent=True, rollout_s=end, back_s=end + switch_out, lender_devices=lender_reps * tp,
                       lender_busy_device_s=lender_work + (switch_in + switch_out) * lender_reps * tp,
                       switch_in_s=switch_in, switch_out_s=switch_out)


__all__ = ["ROLLOUT", "ResizeTiming", "OpTime", "time_plan", "canonical_timing", "LendOutcome", "lend_step",
           "lend_switch_s"]
