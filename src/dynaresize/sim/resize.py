"""Timing of a resize plan from the op cost model, and of intra-step lending.

A plan's ops run per moving device as a chain (`Op.after`); moving devices run in parallel.
The critical path ends when the last critical op of any device ends: the next step starts
then. Background ops overlap the next step; the optimizer-shard ops must end before that
step's optimizer step, so when they end later than the training stage would, training waits
(`optimizer_ready_s`).

Lending (the `lend` baseline, docs/references.md 4: verl's hybrid replicas): when the training stage
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

from dynaresize.control.planner import MOVE_OPTIMIZER_SHARDS, RECEIVE_OPTIMIZER_SHARDS, device_ops
from dynaresize.costmodel.costs import Hardware, ModelPreset, op_cost
from dynaresize.types import ROLLOUT, TRAIN, ResizePlan

LEND_MIGRATE_S = 1.0  # lending: re-prefill of the work moved to lenders (docs/references.md 3.4: RollPacker migration <= 3 s)


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


@lru_cache(maxsize=65536)
def chain_timing(model: ModelPreset, to_role: str, num_train_before: int, num_train_after: int,
                 num_moving: int, hw: Hardware = Hardware()) -> tuple[tuple[str, bool, float, float, float], ...]:
    """(name, critical, start_s, end_s, bytes) of one moving device's op chain. Every moving
    device of a plan runs the same chain at the same time (their costs depend only on the pool
    sizes), so a plan's timing is this chain's."""
    ends: dict[str, float] = {}
    out = []
    for op in device_ops(0, to_role):  # each device's ops come in dependency order
        start = max((ends[a] for a in op.after), default=0.0)
        dur, nbytes = op_cost(op.name, model, num_train_before=num_train_before, num_train_after=num_train_after,
                              num_moving=num_moving, hw=hw)
        ends[op.name] = start + dur
        out.append((op.name, op.critical, start, start + dur, nbytes))
    return tuple(out)


def _summarise(chain, num_moving: int) -> tuple[float, float, float, float]:
    crit = max((e for _, c, _, e, _ in chain if c), default=0.0)
    total = max((e for _, _, _, e, _ in chain), default=0.0)
    opt = max((e for n, _, _, e, _ in chain if n in (MOVE_OPTIMIZER_SHARDS, RECEIVE_OPTIMIZER_SHARDS)), default=0.0)
    return crit, total, opt, num_moving * sum(b for *_, b in chain)


def time_plan(plan: ResizePlan, model: ModelPreset, hw: Hardware = Hardware()) -> ResizeTiming:
    if not plan.moving:
        return ResizeTiming(critical_s=0.0, total_s=0.0, optimizer_ready_s=0.0, ops=(), bytes_moved=0.0)
    chain = chain_timing(model, plan.to_role, plan.src.num_train, plan.dst.num_train, len(plan.moving), hw)
    times = {name: (s, e, b) for name, _, s, e, b in chain}
    ops = tuple(OpTime(name=op.name, device=op.device, critical=op.critical, start_s=times[op.name][0],
                       end_s=times[op.name][1], bytes=times[op.name][2]) for op in plan.ops)
    crit, total, opt, nbytes = _summarise(chain, len(plan.moving))
    return ResizeTiming(critical_s=crit, total_s=total, optimizer_ready_s=opt, ops=ops, bytes_moved=nbytes)


@lru_cache(maxsize=65536)
def canonical_timing(model: ModelPreset, num_devices: int, src_rollout: int, dst_rollout: int,
                     hw: Hardware = Hardware()) -> ResizeTiming:
    """Timing of the plan from split `src_rollout` to `dst_rollout` (ops left out: the sweeps
    need only the totals, which are what the engine pays for the same move)."""
    moving = abs(dst_rollout - src_rollout)
    if moving == 0:
        return ResizeTiming(critical_s=0.0, total_s=0.0, optimizer_ready_s=0.0, ops=(), bytes_moved=0.0)
    to_role = ROLLOUT if dst_rollout > src_rollout else TRAIN
    chain = chain_timing(model, to_role, num_devices - src_rollout, num_devices - dst_rollout, moving, hw)
    crit, total, opt, nbytes = _summarise(chain, moving)
    return ResizeTiming(critical_s=crit, total_s=total, optimizer_ready_s=opt, ops=(), bytes_moved=nbytes)


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
    share of the training state over PCIe (docs/references.md 5) and wake / release an engine (3.3).
    With LoRA the share is the frozen base's and the adapter's (`ModelPreset.trainer_held_bytes`)."""
    share = model.trainer_held_bytes / max(num_train, 1)
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
    fluid_end = t_avail + LEND_MIGRATE_S + movable / (replica_times.size + lender_reps)
    end = max(fluid_end, t_avail + float(serial_left.max()))
    if end + switch_out >= t_roll:  # lending would not end the step sooner
        return none
    lender_work = max(end - t_avail, 0.0) * lender_reps * tp
    return LendOutcome(lent=True, rollout_s=end, back_s=end + switch_out, lender_devices=lender_reps * tp,
                       lender_busy_device_s=lender_work + (switch_in + switch_out) * lender_reps * tp,
                       switch_in_s=switch_in, switch_out_s=switch_out)


__all__ = ["ResizeTiming", "OpTime", "chain_timing", "time_plan", "canonical_timing", "LendOutcome", "lend_step",
           "lend_switch_s"]
