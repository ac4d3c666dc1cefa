"""The streaming pipeline (staleness eta >= 2), driven by the same controller as `sim.engine`.

Semantics (issue 11):
- the samples of step k are generated with the weights of version v(k) = max(0, k - eta);
  version v exists once training step v-1 has ended and the trainers have published it;
- step k is *released* when v(k) exists. Dispatch: a step is cut into shares of
  ceil(samples / replicas) consecutive samples (a prompt's samples stay together: one engine
  request with n samples), at most `slots` each (what a replica admits at once); every free
  replica takes the next share of the oldest released step (first-in first-out), runs it as one
  continuous batch (`StageModel.chunk`). So a replica that has finished its share of step k
  goes on with step k+1, k+2, ... as soon as their weights exist, instead of waiting for the
  step's longest response; a fast replica may take several shares of a step, a slow one fewer.
  A replica whose weights are older than the share's version first pulls that version
  (`costs.sync_s`, counted as work). Bigger shares would raise each replica's concurrency but
  lengthen the step's rollout latency (docs/pipeline.md measures both); the even share keeps
  latency lowest.
- admit (default): a replica holds one weight version; once only its share's longest request is
  left it takes the next share *of the same version* into the same engine iterations (the tail
  finishes alongside it); a share of another version waits until the replica is empty. Without
  admit a replica takes its next share when the current one has ended.
- accumulate (default): the trainers start step k when they are free and k is released, and run
  each chunk's training compute (`StageModel.train_chunk_device_s`, a sum over its sequences) as
  the chunk ends, in the order chunks end (GRPO groups stay whole: a chunk holds whole prompts);
  the fixed part (optimizer step, exposed communication) follows the step's last chunk. Without
  accumulate training step k starts when every chunk of step k has ended. Either way a step's
  compute is the same (`train_s` reports it, waits excluded); when training ends the trainers
  publish version k+1 (`costs.publish_s`) and the controller gets step k's report
  (`sim.stream_train`). Which weights generate a sample depends only on its step.

Bounded window: step k is released only after training step k-eta-1 has ended, so at most
eta+1 steps are in rollout at once and at most eta+1 steps' samples are buffered; every engine
holds one version; at most eta+1 versions are live (the staging buffer keeps a version until the
last replica that needs it has pulled it).

Partial rollout (`partial=True`, includes admit): a replica takes its next chunk as soon as only
its current chunk's longest request is left, whatever its version; that request keeps decoding
in the same engine iterations, under the newer weights the next chunk pulls (its end moves by
the pull's pause). Its tokens
then come from a range of versions whose oldest is v(k), so consumed_step - oldest <= eta
still holds (counted in the summary). On real workers this mode is not deterministic.

Resizes (same controller, plans and op costs as `sim.engine`; `sim.stream_resize`):
- train -> rollout, at the training boundary where the report is made: the remaining trainers
  stall until the parameter shards have moved (the plan's chain up to move_param_shards); the
  moving devices become a replica once the plan's critical path has run; the optimizer shards
  must arrive before the next optimizer step (else that training step waits).
- rollout -> train: MIGRATE, at the same boundary. The moving replicas stop at the decision:
  the samples of their in-flight chunks (partial tails included) that have not finished by then
  go back to the front of their step's dispatch queue (same step, so same weight version) and
  the remaining replicas run them; the samples already finished count as done. Without partial
  rollout a moved sample is decoded again from scratch (its seed belongs to the sample: same
  tokens); with it, it resumes with its prefix (the receiving replica re-prefills prompt +
  prefix and decodes the rest; `StageModel.chunk_at`). The moving devices then run the plan's
  critical path (stop_routing, migrate_requests, release_engine_memory, join_train_group,
  receive_param_shards) while the trainers, free at the boundary, stall for it; the next
  training step runs with them. The moved work is rollout work on the receiving replicas, not
  part of the move's cost; the resize record counts it (`requests_moved`), the run too
  (`migrated_samples`). `sim.stream_resize` says how a sample's finish time inside a chunk is
  modelled. The policy is told the measured cost of a move as the resize idle it caused, in
  seconds of the whole cluster (device-seconds / devices), the same unit as a lock-step stall.
  `migrate=False` keeps the drain of earlier builds as the baseline (`sim.stream_resize`).

Ledger: every sample of every step is generated exactly once (a sample cut by a migration is
counted when it finishes on its new replica); the engine counts each step's samples as they
finish and raises at the step's end if one is missing or doubled.

Idle accounting (`sim.stream_report`), device-seconds, the documented definition (weight sync counts as work):
*bubble* = rollout devices with no chunk to run (the window is full: they wait for weights)
plus trainers waiting for a step's chunks (and for step 0); *resize* = devices on a resize's
critical path, trainers stalled by it; no *tail* idle (a
replica decoding one long request is busy, as in `sim.engine`). A replica's busy time is the
union of what runs on it (a chunk admitted under a tail is not counted twice). idle = bubble +
resize and busy + idle = devices x total time (a unit test checks it in every mode).

Pure except for the optional recorder.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dynaresize.control.controller import Controller
from dynaresize.costmodel.scenarios import Scenario
from dynaresize.costmodel.stages import StageModel
from dynaresize.sim.engine import PolicyResult, _Null
from dynaresize.sim.stream_report import StreamAccounting
from dynaresize.sim.stream_resize import StreamResizes, _Work
from dynaresize.sim.stream_train import StreamTraining
from dynaresize.types import Assignment, Bounds


def rollout_version(step: int, staleness: int) -> int:
    """The weight version that generates the samples of `step`: max(0, step - staleness)."""
    return max(0, step - staleness)


@dataclass(eq=False)
class _Rep:
    rid: int  # its first device
    version: int = -1  # weights it holds (-1: none yet)
    running: bool = False  # a chunk's body (without partial: the whole chunk) is running
    tails: int = 0  # partial: chunks whose longest request still decodes here
    gone: bool = False  # it left for training (its pending events are void)
    draining: bool = False  # migrate=False: it takes no new chunk
    idle_since: float | None = 0.0
    busy_until: float = 0.0  # the last end of anything it runs (a share or a tail under it)
    chunks: list = field(default_factory=list)  # its chunks in flight (the running one and tails)


@dataclass(eq=False)
class _Chunk:
    step: int
    rep: _Rep
    end_s: float
    version_max: int
    lo: int = 0
    hi: int = 0
    token: int = 0
    positions: np.ndarray | None = None  # a chunk with migrated samples: its batch positions (else lo..hi-1)
    done: np.ndarray | None = None  # partial: tokens each position already had (its re-prefilled prefix)
    start_s: float = 0.0  # dispatched (its pull, if any, runs first)
    t0: float = 0.0  # its decoding starts
    pauses: list = field(default_factory=list)  # partial: (at, seconds) pulls its tail waited for
    carry_dev_s: float = 0.0  # accumulate: training compute of a cut chunk's finished samples it brings
    work_s: float = 0.0  # what it added to its step's work_s / serial_s (a cut takes back the unrun part)
    serial_s: float = 0.0

    def sample_positions(self) -> np.ndarray:
        return self.positions if self.positions is not None else np.arange(self.lo, self.hi)


@dataclass(eq=False)
class _Step:
    k: int
    version: int
    released_s: float
    num_samples: int
    slots: int
    next: int = 0  # next sample to dispatch
    left: int = 0  # chunks dispatched and not yet ended
    returned: deque = field(default_factory=deque)  # _Work handed back by a migration, dispatched first
    num_returned: int = 0  # samples in `returned`
    generated: np.ndarray | None = None  # ledger: times each sample has finished (must end all ones)
    chunks: int = 0
    done_s: float | None = None
    work_s: float = 0.0
    serial_s: float = 0.0
    sync_s: float = 0.0
    version_max: int = 0
    mixed: int = 0
    backlog: float = 0.0  # accumulate: training device-seconds of ended chunks the trainers have not taken
    last_train_dev_s: float = 0.0  # accumulate: training device-seconds of the chunk that ended last

    def to_dispatch(self) -> int:
        return self.num_samples - self.next + self.num_returned


class StreamEngine(StreamTraining, StreamResizes, StreamAccounting):
    """One policy on the streaming pipeline; `run()` returns its PolicyResult."""

    def __init__(self, scenario: Scenario, stages: StageModel, policy, bounds: Bounds, *, start_rollout: int,
                 staleness: int, partial: bool = False, accumulate: bool = True, admit: bool = True,
                 reversal_window: int = 0, recorder=None, on_step: Callable[[int], None] | None = None,
                 migrate: bool = True) -> None:
        if staleness < 2:
            raise ValueError(f"staleness={staleness}: the streaming engine needs >= 2 (1 is sim.engine)")
        self.sc, self.stages, self.eta, self.partial = scenario, stages, int(staleness), bool(partial)
        self.accumulate, self.admit = bool(accumulate), bool(admit) or bool(partial)
        self.tr_step: int | None = None  # accumulate: the step the trainers are on
        self.tr_cursor = 0.0  # accumulate: when they finish the chunks they were given
        self.tr_waited: dict[int, float] = {}  # accumulate: device-seconds they waited inside step k
        self.N, self.K, self.tp = scenario.num_devices, scenario.num_steps, stages.tp
        self.rec = recorder if recorder is not None else _Null()
        self.on_step = on_step
        self.ctl = Controller(policy=policy, bounds=bounds, assignment=Assignment.split(self.N, start_rollout))
        self.res = PolicyResult(policy=policy.name, num_devices=self.N, num_steps=self.K, start_rollout=start_rollout,
                                staleness=self.eta, partial=self.partial, max_staleness=0)
        self.reversal_window = reversal_window
        self.lengths_wanted = bool(getattr(policy, "reads_response_lengths", True))
        self.pull_s = stages.sync_s
        self._heap: list = []
        self._seq = 0
        self.reps: dict[int, _Rep] = {rid: _Rep(rid) for rid in range(0, start_rollout, self.tp)}
        self.num_train = self.N - start_rollout
        self.steps: dict[int, _Step] = {}
        self.queue: deque[_Step] = deque()
        self.tails: dict[int, list[_Chunk]] = {}
        self.train_next = 0
        self.trainers_busy = False
        self.stall_until = 0.0
        self.trainer_idle_since: float | None = 0.0
        self.opt_ready: float | None = None
        self.migrate = bool(migrate)
        self.drain = None  # migrate=False: the rollout -> train move waiting for its replicas to empty
        self.measured_cost: float | None = None
        self.train_start: dict[int, tuple[float, int]] = {}
        self.train_dur: dict[int, float] = {}
        self.publish: dict[int, float] = {}
        self.rollout_wait = self.train_wait = self.resize_idle = 0.0
        self.rollout_work = self.train_busy = 0.0
        self.last_report_s = 0.0
        self.idle_at_last_report = 0.0
        self.done = False

    # ------------------------------------------------------------------ event loop

    def push(self, t: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, data))
        self._seq += 1

    def run(self) -> PolicyResult:
        for k in range(min(self.eta + 1, self.K)):
            self.release(k, 0.0)  # version 0 exists from the start
        self.dispatch(0.0)
        handlers = {"done": self.on_done, "free": self.on_free, "chunk_end": self.on_chunk_end,
                    "train_end": self.on_train_end, "published": self.on_published, "try_train": self.try_train,
                    "join_rollout": self.on_join_rollout, "join_ready": self.on_join_ready}
        while self._heap and not self.done:
            t, _, kind, data = heapq.heappop(self._heap)
            if data is None:
                handlers[kind](t)
            else:
                handlers[kind](t, data)
        if not self.done:
            raise RuntimeError("streaming simulation stalled before the last step (a bug)")
        return self.res

    # ------------------------------------------------------------------ rollout

    def release(self, k: int, now: float) -> None:
        st = _Step(k=k, version=rollout_version(k, self.eta), released_s=now,
                   num_samples=self.stages.batch(k).num_samples, slots=self.stages.slots(k))
        st.version_max = st.version
        st.generated = np.zeros(st.num_samples, dtype=np.int32)
        self.steps[k] = st
        self.queue.append(st)

    def dispatch(self, now: float) -> None:
        if not self.queue:
            return
        free = [r for r in self.reps.values() if not r.running and not r.draining]
        if not free:
            return
        free.sort(key=lambda r: r.rid)
        active = len(self.reps) - (len(self.drain.waiting) if self.drain is not None else 0)
        while free and self.queue:
            st = self.queue[0]
            share = min(st.slots, -(-st.num_samples // max(active, 1)))
            ready = [r for r in free if r.version == st.version]  # no pull needed: served first
            # A replica still decoding tails (admit) takes only a share of the version it holds.
            order = ready + [r for r in free if r.version != st.version and (self.partial or not r.tails)]
            used = 0
            for rep in order:
                if st.to_dispatch() <= 0:
                    break
                self.start_chunk(rep, st, now, min(share, st.to_dispatch()))
                used += 1
            if used == 0 and st.to_dispatch() > 0:
                break  # the free replicas still decode another version's tails
            free = order[used:] + [r for r in free if r not in order]
            free.sort(key=lambda r: r.rid)
            if st.to_dispatch() <= 0:
                self.queue.popleft()

    def start_chunk(self, rep: _Rep, st: _Step, now: float, m: int) -> None:
        positions, done, vmax, carry = self._take(st, m)
        lo = st.next
        if positions is None:
            st.next += m
            ch = self.stages.chunk(st.k, lo, lo + m)
        else:
            ch = self.stages.chunk_at(st.k, positions, done)
        st.left += 1
        st.chunks += 1
        pull = self.pull_s if rep.version != st.version else 0.0
        if rep.idle_since is not None:
            self.rollout_wait += (now - rep.idle_since) * self.tp
            rep.idle_since = None
        if pull > 0 and rep.tails:  # partial: running tails pause for the pull, then go on under the new weights
            for c in self.tails[rep.rid]:
                c.end_s += pull
                c.token += 1
                c.pauses.append((now, pull))
                c.version_max = max(c.version_max, st.version)
                self.push(c.end_s, "chunk_end", (c, c.token))
        rep.version = st.version
        t0 = now + pull
        time_s = ch.time_s
        end = t0 + time_s
        body_end = t0 + ch.body_s if self.admit else end
        # Busy is the union of what runs on the replica: a share admitted under a tail (admit,
        # partial) overlaps it and is not counted twice, so busy + idle = devices x time. The
        # step is told the same: the overlap is serial decode steps the tail did not cost.
        ends = [end] + [c.end_s for c in self.tails.get(rep.rid, ())]
        hidden = max(0.0, min(end, rep.busy_until) - now) if rep.tails else 0.0
        self.rollout_work += max(0.0, max(ends) - max(now, rep.busy_until)) * self.tp
        rep.busy_until = max([rep.busy_until] + ends)
        work_s, serial_s = (time_s - hidden) * self.tp, max(ch.serial_s - hidden, 0.0) * self.tp
        st.work_s += work_s
        st.serial_s += serial_s
        st.sync_s += pull * self.tp
        c = _Chunk(step=st.k, rep=rep, end_s=end, version_max=max(st.version, vmax), lo=lo,
                   hi=lo + (m if positions is None else 0), positions=positions, done=done, start_s=now, t0=t0,
                   carry_dev_s=carry, work_s=work_s, serial_s=serial_s)
        rep.running = True
        rep.chunks.append(c)
        if self.admit and end > body_end + 1e-9:
            rep.tails += 1
            self.tails.setdefault(rep.rid, []).append(c)
            self.push(body_end, "free", rep)
            self.push(end, "chunk_end", (c, c.token))
        else:
            self.push(end, "done", (c, c.token))

    def on_done(self, now: float, data) -> None:
        c, token = data
        if token != c.token:
            return  # cut by a migration
        self._chunk_ended(c, now)
        self.on_free(now, c.rep)

    def on_free(self, now: float, rep: _Rep) -> None:
        if rep.gone:
            return  # it left for training
        rep.running = False
        if rep.tails == 0:
            rep.idle_since = now
        if rep.draining:
            self._check_drained(rep, now)
        else:
            self.dispatch(now)

    def on_chunk_end(self, now: float, data) -> None:
        c, token = data
        if token != c.token:
            return  # re-timed by a pull's pause, or cut by a migration
        rep = c.rep
        rep.tails -= 1
        self.tails[rep.rid].remove(c)
        if not rep.running and rep.tails == 0:
            rep.idle_since = now
            if rep.draining:
                self._check_drained(rep, now)
        self._chunk_ended(c, now)
        if self.admit and not self.partial and not rep.running and rep.tails == 0 and not rep.draining:
            self.dispatch(now)  # it may now pull another version

    def _chunk_ended(self, c: _Chunk, now: float) -> None:
        st = self.steps[c.step]
        st.left -= 1
        c.rep.chunks.remove(c)
        if c.positions is None:
            st.generated[c.lo:c.hi] += 1
        else:
            np.add.at(st.generated, c.positions, 1)
        if c.version_max > st.version:
            st.mixed += 1
            st.version_max = max(st.version_max, c.version_max)
        if self.accumulate:
            w = (self.stages.train_chunk_device_s(c.step, c.lo, c.hi) if c.positions is None
                 else self.stages.train_at_device_s(c.step, c.positions)) + c.carry_dev_s
            self._train_input(st, w, now)
        self._maybe_done(st, now)

    def _train_input(self, st: _Step, w: float, now: float) -> None:
        """Accumulate: `w` device-seconds of step st's training compute are ready now."""
        st.last_train_dev_s = w
        if self.tr_step == st.k:
            self._feed(st.k, w, now)
        else:
            st.backlog += w

    def _maybe_done(self, st: _Step, now: float) -> None:
        if st.left == 0 and st.to_dispatch() <= 0:
            if not (st.generated == 1).all():  # the ledger: each sample finished exactly once
                raise RuntimeError(f"step {st.k}: samples generated {sorted(set(st.generated.tolist()))} times (a bug)")
            st.done_s = now
            if self.accumulate and self.tr_step == st.k:
                self._finish_train(st.k, now)
            else:
                self.try_train(now)

    def add_replica(self, rid: int, now: float) -> None:
        """A device (group of tp devices) joined the rollout pool: a replica taking work from now."""
        self.reps[rid] = _Rep(rid=rid, idle_since=now)


def run_stream(scenario: Scenario, stages: StageModel, policy, bounds: Bounds, *, start_rollout: int, staleness: int,
               partial: bool = False, accumulate: bool = True, admit: bool = True, reversal_window: int = 0,
               recorder=None, on_step: Callable[[int], None] | None = None, migrate: bool = True) -> PolicyResult:
    """Simulate one policy on the streaming pipeline (see the module docstring)."""
    return StreamEngine(scenario, stages, policy, bounds, start_rollout=start_rollout, staleness=staleness,
                        partial=partial, accumulate=accumulate, admit=admit, reversal_window=reversal_window,
                        recorder=recorder, on_step=on_step, migrate=migrate).run()
