"""Idle accounting and step reports of the streaming engine (`sim.stream`).

Idle, device-seconds (weight sync counts as work): *bubble* = rollout devices with no chunk to
run plus trainers waiting for a step's chunks (and for step 0); *resize* = devices on a resize's
critical path and trainers stalled by it (migrate=False: drained devices waiting to join); no
*tail* idle. A replica's busy time is the union of what runs on it, so busy + idle = devices x
total time.
Each step's report is what the controller (and the streaming throughput model) reads.

A mixin of `StreamEngine`: it reads the engine's replicas, trainers, steps and counters.
Pure except for the optional recorder.
"""

from __future__ import annotations

from dynaresize.types import StepReport


class StreamAccounting:
    """Idle, the step reports and the run's totals of `StreamEngine` (see the module docstring)."""

    def idle_until(self, now: float) -> float:
        """Idle device-seconds from the start up to `now` (without changing any state)."""
        idle = self.rollout_wait + self.train_wait + self.resize_idle
        for r in self.reps.values():
            if r.idle_since is not None and now > r.idle_since:
                idle += (now - r.idle_since) * self.tp
        if self.trainer_idle_since is not None and now > self.trainer_idle_since:
            idle += (now - self.trainer_idle_since) * self.num_train
        return idle + self.drained_idle(now)

    def account(self, k: int, now: float) -> StepReport:
        st = self.steps[k]
        start, n = self.train_start[k]
        idle = self.idle_until(now)
        step_idle = idle - self.idle_at_last_report
        self.idle_at_last_report = idle
        d = self.stages.data(k)
        lengths = self.stages.batch(k).response_tokens
        a = self.ctl.assignment
        step_s = now - self.last_report_s
        self.res.timeline.append((k, self.last_report_s, now, a.num_rollout))
        self.res.max_staleness = max(self.res.max_staleness, k - st.version)
        self.res.mixed_version_samples += st.mixed
        self.res.max_version_span = max(self.res.max_version_span, st.version_max - st.version)
        rollout_s = (st.done_s or now) - st.released_s
        # The training that cannot start before the step's last sample (what the window must
        # hold): all of it, or with accumulate the last chunk's share and the fixed part.
        fixed = self.stages.model.train_comm_s
        train_tail = (min(fixed + st.last_train_dev_s / n, self.train_dur[k]) if self.accumulate
                      else self.train_dur[k])
        self.rec.emit("step", step=k, t_start_s=self.last_report_s, t_end_s=now, rollout_s=rollout_s,
                      train_s=self.train_dur[k], sync_s=self.publish[k], num_rollout=a.num_rollout, num_train=n,
                      idle_device_s=step_idle, tail_idle_device_s=0.0, step_s=step_s, staleness=self.eta,
                      version=st.version, version_max=st.version_max, mixed_version_samples=st.mixed,
                      released_s=st.released_s, rollout_done_s=st.done_s, train_start_s=start,
                      rollout_work_s=st.work_s, rollout_serial_s=st.serial_s, rollout_sync_s=st.sync_s,
                      train_tail_s=train_tail, rollout_chunks=st.chunks, rollout_floor_s=d.floor_s,
                      rollout_slots=st.slots)
        report = StepReport(step=k, now_s=now, num_rollout=a.num_rollout, num_train=n, rollout_s=rollout_s,
                            train_s=self.train_dur[k], sync_s=self.publish[k], step_s=step_s,
                            rollout_work_s=st.work_s, rollout_longest_s=d.floor_s,
                            train_fixed_s=self.stages.model.train_comm_s, num_samples=int(lengths.size),
                            response_tokens=int(lengths.sum()), idle_device_s=step_idle, tail_idle_device_s=0.0,
                            resize_critical_s=self.measured_cost, rollout_floor_s=d.floor_s,
                            rollout_longest_tokens=int(lengths.max()) if lengths.size else 0,
                            rollout_chunks=st.chunks, rollout_slots=st.slots, rollout_serial_s=st.serial_s,
                            rollout_sync_s=st.sync_s, train_tail_s=train_tail,
                            response_lengths=tuple(lengths.tolist()) if self.lengths_wanted else ())
        self.measured_cost = None
        self.last_report_s = now
        return report

    def finish(self, now: float) -> None:
        self.done = True
        self.account(self.K - 1, now)
        if self.on_step is not None:
            self.on_step(self.K - 1)
        res = self.res
        self.resize_idle += self.drained_idle(now)  # migrate=False: drained devices that never joined
        for r in self.reps.values():
            if r.idle_since is not None:
                self.rollout_wait += (now - r.idle_since) * self.tp
                r.idle_since = now
        res.total_time_s = now
        res.rollout_wait_idle_device_s = self.rollout_wait
        res.train_wait_idle_device_s = self.train_wait
        res.resize_idle_device_s = self.resize_idle
        res.bubble_idle_device_s = self.rollout_wait + self.train_wait
        res.tail_idle_device_s = 0.0
        res.idle_device_s = res.bubble_idle_device_s + res.resize_idle_device_s
        res.busy_device_s = self.rollout_work + self.train_busy
        res.rollout_devices_final = self.ctl.assignment.num_rollout
        res.reversals = self.ctl.history.count_reversals(self.reversal_window)
        res.num_samples = self.sc.total_samples()
