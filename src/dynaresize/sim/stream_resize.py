"""Resizes in the streaming engine (`sim.stream`): the controller's plans, timed by the same op
costs as `sim.engine` (`sim.resize`).

- train -> rollout, at the training boundary where the report is made: the remaining trainers
  stall until the parameter shards have moved (the plan's chain up to move_param_shards); the
  moving devices become a replica once the plan's critical path has run; the optimizer shards
  must arrive before the next optimizer step.
- rollout -> train: drain. The moving replicas get no new chunk and finish what they run; once
  empty they join the trainers at the next training boundary, where all trainers stall for
  join_train_group + receive_param_shards.

A mixin of `StreamEngine` (it reads and updates the engine's replicas, trainers and idle
counters; `add_replica` is the engine's). Pure except for the optional recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynaresize.control.planner import JOIN_TRAIN_GROUP, MOVE_PARAM_SHARDS, RECEIVE_PARAM_SHARDS
from dynaresize.control.state import Refusal
from dynaresize.sim.resize import ResizeTiming, chain_timing, time_plan
from dynaresize.types import ROLLOUT, ResizePlan


@dataclass(eq=False)
class _Drain:
    plan: ResizePlan
    timing: ResizeTiming
    decided_s: float
    waiting: set  # replica ids not yet empty
    drained_s: dict  # replica id -> when it was empty
    ready_s: float | None = None  # when the drained devices can join the trainers


class StreamResizes:
    """The resize handlers of `StreamEngine` (see the module docstring)."""

    def apply(self, cmd, now: float, k: int) -> None:
        if isinstance(cmd, Refusal):
            self.res.refusals += 1
            self.rec.emit("refused", step=cmd.step, requested_rollout=cmd.requested_rollout, reason=cmd.reason)
            return
        assert isinstance(cmd, ResizePlan)
        timing = time_plan(cmd, self.stages.model, self.stages.hw)
        self.res.resizes += 1
        self.res.resize_critical_s += timing.critical_s
        self.res.resize_total_s += timing.total_s
        chain = {name: (s, e) for name, _, s, e, _ in chain_timing(self.stages.model, cmd.to_role, cmd.src.num_train,
                                                                    cmd.dst.num_train, len(cmd.moving),
                                                                    self.stages.hw)}
        if cmd.to_role == ROLLOUT:
            m, n_old = len(cmd.moving), self.num_train
            stall = chain[MOVE_PARAM_SHARDS][1]
            self._flush_trainers(now)
            cost = stall * (n_old - m) + timing.critical_s * m
            self.resize_idle += cost
            self.num_train = n_old - m
            self.stall_until = now + stall
            self.trainer_idle_since = now + stall
            self.opt_ready = now + timing.optimizer_ready_s
            self.measured_cost = cost / self.N
            self._emit_resize(cmd, timing, k, now, now, drain_s=0.0, stall_device_s=cost)
            self.push(now + timing.critical_s, "join_rollout", cmd)
        else:
            moving = set(cmd.moving)
            rids = {rid for rid in self.reps if rid in moving}
            self.drain = _Drain(plan=cmd, timing=timing, decided_s=now, waiting=set(rids), drained_s={})
            for rid in sorted(rids):
                rep = self.reps[rid]
                rep.draining = True
                self.active_reps -= 1
                self._check_drained(rep, now)

    def on_join_rollout(self, now: float, plan: ResizePlan) -> None:
        for d in sorted(plan.moving)[:: self.tp]:
            self.add_replica(d, now)
        self.ctl.on_resize_done(plan.resize_id, *self._timing_pair(plan))
        self.dispatch(now)

    def _timing_pair(self, plan: ResizePlan) -> tuple[float, float]:
        t = time_plan(plan, self.stages.model, self.stages.hw)
        return t.critical_s, t.total_s

    def _check_drained(self, rep: Any, now: float) -> None:
        d = self.drain
        if d is None or rep.rid not in d.waiting or rep.running or rep.tails:
            return
        d.waiting.discard(rep.rid)
        d.drained_s[rep.rid] = now
        if rep.idle_since is not None:
            self.rollout_wait += (now - rep.idle_since) * self.tp
        del self.reps[rep.rid]
        if not d.waiting:
            chain = chain_timing(self.stages.model, d.plan.to_role, d.plan.src.num_train, d.plan.dst.num_train,
                                 len(d.plan.moving), self.stages.hw)
            join_off = next(s for name, _, s, _, _ in chain if name == JOIN_TRAIN_GROUP)
            d.ready_s = now + join_off
            self.res.drain_s += now - d.decided_s
            self.push(d.ready_s, "join_ready")

    def on_join_ready(self, now: float) -> None:
        if not self.trainers_busy and now >= self.stall_until - 1e-12:
            self.apply_join(now)

    def apply_join(self, now: float) -> None:
        d = self.drain
        assert d is not None and d.ready_s is not None
        chain = {name: (s, e) for name, _, s, e, _ in chain_timing(self.stages.model, d.plan.to_role,
                                                                    d.plan.src.num_train, d.plan.dst.num_train,
                                                                    len(d.plan.moving), self.stages.hw)}
        join_off = chain[JOIN_TRAIN_GROUP][0]
        stall = chain[RECEIVE_PARAM_SHARDS][1] - join_off
        n_old = self.num_train
        self._flush_trainers(now)
        transit = sum((now + stall - t) * self.tp for t in d.drained_s.values())
        cost = stall * n_old + transit
        self.resize_idle += cost
        self.num_train = n_old + len(d.plan.moving)
        self.stall_until = now + stall
        self.trainer_idle_since = now + stall
        self.opt_ready = now + d.timing.optimizer_ready_s - join_off
        self.measured_cost = cost / self.N
        self.drain = None
        self._emit_resize(d.plan, d.timing, d.plan.step, min(d.drained_s.values()), now - join_off,
                          drain_s=max(d.drained_s.values()) - d.decided_s, stall_device_s=cost)
        self.ctl.on_resize_done(d.plan.resize_id, d.timing.critical_s, d.timing.total_s)
        self.push(self.stall_until, "try_train")

    def _emit_resize(self, plan: ResizePlan, timing: ResizeTiming, k: int, pre_base: float, base: float, *,
                     drain_s: float, stall_device_s: float) -> None:
        join_off = None
        for op in timing.ops:
            if op.name == JOIN_TRAIN_GROUP:
                join_off = op.start_s
        for op in timing.ops:
            t0 = pre_base if (join_off is not None and op.start_s < join_off) else base
            self.rec.emit("op", resize_id=plan.resize_id, name=op.name, device=op.device, start_s=t0 + op.start_s,
                          end_s=t0 + op.end_s, bytes=op.bytes, critical=op.critical)
        ends = {"from": plan.src.to_json(), "to": plan.dst.to_json()}
        self.rec.emit("resize", resize_id=plan.resize_id, step=k, **ends, moving=list(plan.moving),
                      to_role=plan.to_role, critical_s=timing.critical_s, total_s=timing.total_s,
                      bytes=timing.bytes_moved, reason=plan.reason, drain_s=drain_s, stall_device_s=stall_device_s)
