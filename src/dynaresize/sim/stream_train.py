"""The training side of the streaming engine (`sim.stream`): when the trainers take a step,
how long it lasts, and what follows it (publishing the new version, the step's report, the
controller's commands, releasing the step that version allows).

With `accumulate` the trainers take a step's compute chunk by chunk as its samples arrive
(`_feed`) and the fixed part (optimizer step, exposed communication) follows the last chunk
(`_finish_train`); without it a step trains once all its samples are in. Trainer time spent
waiting for chunks counts as idle, not as the step's compute, so the policy fits compute only.

A mixin of `StreamEngine`: it reads and sets the engine's trainer fields (`trainers_busy`,
`train_start`, `train_dur`, `tr_*`, `opt_ready`, ...). Pure.
"""

from __future__ import annotations

from dynaresize.control.controller import decision_fields
from dynaresize.costmodel.costs import publish_s


class StreamTraining:
    """The trainers of `StreamEngine` (see the module docstring)."""

    def try_train(self, now: float) -> None:
        if self.trainers_busy or self.done:
            return
        if now < self.stall_until - 1e-12:
            self.push(self.stall_until, "try_train")
            return
        d = self.drain  # migrate=False: drained devices join at this boundary
        if d is not None and d.ready_s is not None and d.ready_s <= now + 1e-12:
            self.apply_join(now)
            return
        k = self.train_next
        st = self.steps.get(k)
        if k >= self.K or st is None or (st.done_s is None and not self.accumulate):
            return
        n = self.num_train
        self._flush_trainers(now)
        self.trainer_idle_since = None
        if self.accumulate:
            self.trainers_busy = True
            self.train_start[k] = (now, n)
            self.tr_step, self.tr_cursor, self.tr_waited[k] = k, now, 0.0
            self._feed(k, st.backlog, now)
            st.backlog = 0.0
            if st.done_s is not None:
                self._finish_train(k, now)
            return
        dur = self.stages.train(k, n).time_s
        if self.opt_ready is not None:
            dur = max(dur, self.opt_ready - now)
            self.opt_ready = None
        self.trainers_busy = True
        self.train_start[k] = (now, n)
        self.train_dur[k] = dur
        self.push(now + dur, "train_end", k)

    def _feed(self, k: int, device_s: float, now: float) -> None:
        """Accumulate: the trainers take `device_s` of step k's compute when they are free, from now."""
        n = self.train_start[k][1]
        if now > self.tr_cursor:
            self.tr_waited[k] += (now - self.tr_cursor) * n
            self.tr_cursor = now
        self.tr_cursor += device_s / n

    def _finish_train(self, k: int, now: float) -> None:
        """Accumulate: every chunk of step k is in; the fixed part (optimizer step, exposed
        communication) follows the last chunk's compute."""
        start, n = self.train_start[k]
        end = max(self.tr_cursor, now) + self.stages.model.train_comm_s
        if self.opt_ready is not None:
            end = max(end, self.opt_ready)
            self.opt_ready = None
        self.tr_step = None
        self.train_dur[k] = end - start - self.tr_waited[k] / n  # compute only: what the policy fits
        self.push(end, "train_end", k)

    def on_train_end(self, now: float, k: int) -> None:
        start, n = self.train_start[k]
        waited = self.tr_waited.pop(k, 0.0)
        self.train_busy += (now - start) * n - waited
        self.train_wait += waited
        self.train_next = k + 1
        if k == self.K - 1:
            self.publish[k] = 0.0
            self.finish(now)
            return
        pub = publish_s(self.stages.model, n, self.stages.hw)
        self.publish[k] = pub
        self.train_busy += pub * n
        self.push(now + pub, "published", k)

    def on_published(self, now: float, k: int) -> None:
        self.trainers_busy = False
        self.trainer_idle_since = now
        report = self.account(k, now)
        if self.on_step is not None:
            self.on_step(k)
        for cmd in self.ctl.on_report(report):
            self.apply(cmd, now, k)
        self.rec.emit("decision", step=k, **decision_fields(self.ctl))
        nxt = k + 1 + self.eta  # version k+1 now exists
        if nxt < self.K:
            self.release(nxt, now)
        self.try_train(now)
        self.dispatch(now)

    def _flush_trainers(self, now: float) -> None:
        if self.trainer_idle_since is not None and now > self.trainer_idle_since:
            self.train_wait += (now - self.trainer_idle_since) * self.num_train
            self.trainer_idle_since = now
