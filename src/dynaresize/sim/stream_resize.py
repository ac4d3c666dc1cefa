"""Resizes in the streaming engine (`sim.stream`): the controller's plans, timed by the same op
costs as `sim.engine` (`sim.resize`).

- train -> rollout, at the training boundary where the report is made: the remaining trainers
  stall until the parameter shards have moved (the plan's chain up to move_param_shards); the
  moving devices become a replica once the plan's critical path has run; the optimizer shards
  must arrive before the next optimizer step.
- rollout -> train, at the same boundary: migrate. The moving replicas stop at once; what they
  ran that has not finished goes back to the remaining replicas (`_migrate_replica`); the moving
  devices run the plan's critical path (stop_routing, migrate_requests, release_engine_memory,
  join_train_group, receive_param_shards) while the trainers, free at the boundary, stall for
  it; the optimizer shards must arrive before the next optimizer step.

When a sample of a cut chunk finishes (`StageModel.finish_offsets`): the chunk's decode steps
run in lock-step from its start (after its pull); each step costs the weight read plus what
every request still running in it costs (prefill on its first step, then its KV reads and
compute); sample i ends at the step its last token is decoded, so it finishes at about
t0 + (L_i / l_max) x the chunk's decode time, a little later (the short ones share the early,
full steps), and the longest at the chunk's end. A partial-rollout tail's pauses for a pull
move the samples that had not finished by then. A sample finished by the decision counts as
done; an unfinished one is handed back with the tokens it holds (`StageModel.tokens_after`):
under partial rollout it keeps them as a prefix, otherwise it starts again from scratch.

`migrate=False` keeps the drain of earlier builds as the baseline migration is measured against
(tests/unit/test_sim_migrate.py; not a CLI option): the moving replicas get no new chunk and
finish what they run (partial tails included); once all are empty their pre-join ops run and
they join the trainers at the next training boundary, where all trainers stall for
join_train_group + receive_param_shards; the wait from the decision is the record's `drain_s`.

A mixin of `StreamEngine` (it reads and updates the engine's replicas, steps, trainers and
idle counters; `add_replica`, `requeue` and `_chunk_ended` are the engine's). Pure except for
the optional recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynaresize.control.planner import JOIN_TRAIN_GROUP, MIGRATE_REQUESTS, MOVE_PARAM_SHARDS, RECEIVE_PARAM_SHARDS
from dynaresize.control.state import Refusal
from dynaresize.sim.resize import ResizeTiming, chain_timing, time_plan
from dynaresize.types import ROLLOUT, ResizePlan


@dataclass(eq=False)
class _Work:
    """Samples handed back by a migration, dispatched before their step's next consecutive sample."""

    positions: np.ndarray
    done: np.ndarray | None  # partial: the prefix each keeps (tokens)
    version_max: int  # partial: the newest version its prefixes came from
    carry_dev_s: float  # accumulate: training compute of the cut chunk's finished samples (fed with the last piece)


@dataclass(eq=False)
class _Drain:
    """migrate=False: a rollout -> train move waiting for its replicas to empty."""

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
        m, n_old = len(cmd.moving), self.num_train
        if cmd.to_role != ROLLOUT and not self.migrate:
            self._start_drain(cmd, timing, now)
            return
        moved = None  # rollout -> train: samples handed back, per leaving replica (its first device)
        if cmd.to_role == ROLLOUT:
            chain = {name: (s, e) for name, _, s, e, _ in chain_timing(self.stages.model, cmd.to_role,
                                                                        cmd.src.num_train, cmd.dst.num_train, m,
                                                                        self.stages.hw)}
            stall = chain[MOVE_PARAM_SHARDS][1]
            cost = stall * (n_old - m) + timing.critical_s * m
        else:
            moving = set(cmd.moving)
            moved = {rid: self._migrate_replica(self.reps[rid], now) for rid in sorted(self.reps) if rid in moving}
            self.res.migrated_samples += sum(moved.values())
            stall = timing.critical_s
            cost = stall * (n_old + m)
        self._flush_trainers(now)
        self.resize_idle += cost
        self.num_train = n_old - m if cmd.to_role == ROLLOUT else n_old + m
        self.stall_until = now + stall
        self.trainer_idle_since = now + stall
        self.opt_ready = now + timing.optimizer_ready_s
        self.measured_cost = cost / self.N
        self._emit_resize(cmd, timing, k, now, now, drain_s=0.0, requests_moved=moved, stall_device_s=cost)
        if cmd.to_role == ROLLOUT:
            self.push(now + timing.critical_s, "join_rollout", cmd)
        else:
            self.ctl.on_resize_done(cmd.resize_id, timing.critical_s, timing.total_s)

    def on_join_rollout(self, now: float, plan: ResizePlan) -> None:
        for d in sorted(plan.moving)[:: self.tp]:
            self.add_replica(d, now)
        t = time_plan(plan, self.stages.model, self.stages.hw)
        self.ctl.on_resize_done(plan.resize_id, t.critical_s, t.total_s)
        self.dispatch(now)

    def _migrate_replica(self, rep: Any, now: float) -> int:
        """Stop replica `rep` at `now` for a move to training: its unfinished samples go back to
        their steps' dispatch queues; it leaves the pool. Returns the samples moved."""
        moved = sum(self._cut(c, now) for c in list(rep.chunks))
        if rep.idle_since is not None:
            self.rollout_wait += (now - rep.idle_since) * self.tp
        if rep.busy_until > now:  # its busy time was counted up to the end of what it ran
            self.rollout_work -= (rep.busy_until - now) * self.tp
        rep.gone, rep.running, rep.tails, rep.idle_since = True, False, 0, None
        self.tails.pop(rep.rid, None)
        del self.reps[rep.rid]
        return moved

    def _cut(self, c: Any, now: float) -> int:
        """Cut chunk `c` at `now`: its finished samples are done, the others handed back (see the
        module docstring). Returns the samples handed back."""
        st = self.steps[c.step]
        c.token += 1  # its pending done / chunk_end events are void
        pos = c.sample_positions()
        fin = c.t0 + self.stages.finish_offsets(c.step, pos, c.done)
        for at, p in c.pauses:
            fin = np.where(fin > at, fin + p, fin)
        left = fin > now + 1e-9
        if not left.any():  # it ends at this very instant
            self._chunk_ended(c, now)
            return 0
        st.left -= 1
        c.rep.chunks.remove(c)
        done_pos, moved = pos[~left], pos[left]
        np.add.at(st.generated, done_pos, 1)
        # the step's work loses the part not run (pro rata of the chunk's time)
        undone = min(max((c.end_s - now) / max(c.end_s - c.start_s, 1e-12), 0.0), 1.0)
        st.work_s -= undone * c.work_s
        st.serial_s -= undone * c.serial_s
        prefix, vmax = None, st.version
        if self.partial:
            paused = sum(min(max(now - at, 0.0), p) for at, p in c.pauses)
            prefix = self.stages.tokens_after(c.step, pos, now - c.t0 - paused, c.done)[left]  # the whole batch paces it
            if prefix.any():
                vmax = c.version_max
        carry = c.carry_dev_s
        if self.accumulate and done_pos.size:
            carry += self.stages.train_at_device_s(c.step, done_pos)
        self.requeue(st, _Work(positions=moved, done=prefix, version_max=vmax, carry_dev_s=carry))
        return int(moved.size)

    # ------------------------------------------------------------------ migration: the dispatch side

    def requeue(self, st: Any, work: _Work) -> None:
        """Samples a migration handed back: first in their step's dispatch order, the step back
        in the queue (oldest step first) if it had left it."""
        st.returned.append(work)
        st.num_returned += int(work.positions.size)
        if not any(q is st for q in self.queue):
            i = next((i for i, q in enumerate(self.queue) if q.k > st.k), len(self.queue))
            self.queue.insert(i, st)

    def _take(self, st: Any, m: int):
        """The next m samples of step `st`: handed-back ones first, then consecutive ones.
        (positions or None for st.next.., prefix tokens or None, newest prefix version, carry)."""
        if not st.returned:
            return None, None, st.version, 0.0
        parts, dones, vmax, carry, want = [], [], st.version, 0.0, m
        while st.returned and want > 0:
            w = st.returned[0]
            n = min(want, int(w.positions.size))
            parts.append(w.positions[:n])
            dones.append(w.done[:n] if w.done is not None else np.zeros(n, dtype=np.int64))
            vmax = max(vmax, w.version_max)
            if n == w.positions.size:
                st.returned.popleft()
                carry += w.carry_dev_s
            else:
                w.positions = w.positions[n:]
                w.done = w.done[n:] if w.done is not None else None
            st.num_returned -= n
            want -= n
        if want > 0:
            parts.append(np.arange(st.next, st.next + want))
            dones.append(np.zeros(want, dtype=np.int64))
            st.next += want
        return np.concatenate(parts), (np.concatenate(dones) if self.partial else None), vmax, carry

    # ------------------------------------------------------------------ migrate=False: the drain baseline

    def _start_drain(self, plan: ResizePlan, timing: ResizeTiming, now: float) -> None:
        rids = {rid for rid in self.reps if rid in set(plan.moving)}
        self.drain = _Drain(plan=plan, timing=timing, decided_s=now, waiting=set(rids), drained_s={})
        for rid in sorted(rids):
            self.reps[rid].draining = True
            self._check_drained(self.reps[rid], now)

    def _check_drained(self, rep: Any, now: float) -> None:
        d = self.drain
        if d is None or rep.rid not in d.waiting or rep.running or rep.tails:
            return
        d.waiting.discard(rep.rid)
        d.drained_s[rep.rid] = now
        if rep.idle_since is not None:
            self.rollout_wait += (now - rep.idle_since) * self.tp
        rep.gone = True
        del self.reps[rep.rid]
        if not d.waiting:
            d.ready_s = now + self._join_offsets(d.plan)[0]
            self.push(d.ready_s, "join_ready")

    def _join_offsets(self, plan: ResizePlan) -> tuple[float, float]:
        """(start of join_train_group, end of receive_param_shards) in a device's op chain."""
        chain = {name: (s, e) for name, _, s, e, _ in chain_timing(self.stages.model, plan.to_role,
                                                                    plan.src.num_train, plan.dst.num_train,
                                                                    len(plan.moving), self.stages.hw)}
        return chain[JOIN_TRAIN_GROUP][0], chain[RECEIVE_PARAM_SHARDS][1]

    def drained_idle(self, now: float) -> float:
        """Device-seconds drained devices have waited to join, up to `now`."""
        return 0.0 if self.drain is None else sum((now - t) * self.tp for t in self.drain.drained_s.values())

    def on_join_ready(self, now: float) -> None:
        if not self.trainers_busy and now >= self.stall_until - 1e-12:
            self.apply_join(now)

    def apply_join(self, now: float) -> None:
        d = self.drain
        assert d is not None and d.ready_s is not None
        join_off, receive_end = self._join_offsets(d.plan)
        stall = receive_end - join_off
        n_old = self.num_train
        self._flush_trainers(now)
        cost = stall * n_old + self.drained_idle(now + stall)
        self.resize_idle += cost
        self.num_train = n_old + len(d.plan.moving)
        self.stall_until = now + stall
        self.trainer_idle_since = now + stall
        self.opt_ready = now + d.timing.optimizer_ready_s - join_off
        self.measured_cost = cost / self.N
        self.drain = None
        self._emit_resize(d.plan, d.timing, d.plan.step, min(d.drained_s.values()), now - join_off,
                          drain_s=max(d.drained_s.values()) - d.decided_s, requests_moved={}, stall_device_s=cost)
        self.ctl.on_resize_done(d.plan.resize_id, d.timing.critical_s, d.timing.total_s)
        self.push(self.stall_until, "try_train")

    def _emit_resize(self, plan: ResizePlan, timing: ResizeTiming, k: int, pre_base: float, base: float, *,
                     drain_s: float, requests_moved: dict[int, int] | None, stall_device_s: float) -> None:
        """The op and resize records. Ops before join_train_group run from `pre_base`, the rest from
        `base` (the same instant but under the drain). `drain_s`: 0 when migrating."""
        join_off = next((op.start_s for op in timing.ops if op.name == JOIN_TRAIN_GROUP), None)
        for op in timing.ops:
            t0 = pre_base if (join_off is not None and op.start_s < join_off) else base
            extra = ({"requests_moved": requests_moved.get(op.device, 0)}
                     if requests_moved is not None and op.name == MIGRATE_REQUESTS else {})
            self.rec.emit("op", resize_id=plan.resize_id, name=op.name, device=op.device, start_s=t0 + op.start_s,
                          end_s=t0 + op.end_s, bytes=op.bytes, critical=op.critical, **extra)
        ends = {"from": plan.src.to_json(), "to": plan.dst.to_json()}
        moved = {} if requests_moved is None else {"requests_moved": sum(requests_moved.values())}
        self.rec.emit("resize", resize_id=plan.resize_id, step=k, **ends, moving=list(plan.moving),
                      to_role=plan.to_role, critical_s=timing.critical_s, total_s=timing.total_s,
                      bytes=timing.bytes_moved, reason=plan.reason, drain_s=drain_s, stall_device_s=stall_device_s,
                      **moved)
