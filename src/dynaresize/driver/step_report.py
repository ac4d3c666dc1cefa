"""The step report of the real runtime: what a finished window tells the controller (a
`StepReport`) and the record stream (a `step` record and the weight sync's `span` records).

Times are the run's seconds (`emulate.clock`: emulated ones with `cluster.emulate`); a stage's
time is its span on the devices that ran it, busy and idle device-seconds are counted the way
the simulator counts them (`metrics`, docs/records.md), and the training demand of the step
just trained and of the next one goes with a one-step-off report (under streaming, what the
streaming throughput model reads instead). A mixin of `driver.run.Run`: it reads the run's
assignment, rollouts, timing, ledger and streaming window.
"""

from __future__ import annotations

import time
from typing import Any

from dynaresize.driver.job import ScoredStep
from dynaresize.pipeline.concurrency import concurrency_summary
from dynaresize.pipeline.stepstate import Window
from dynaresize.types import StepReport


class StepReporting:
    """`_report` and its parts, of `Run` (see the module docstring)."""

    def _report(self, w: Window) -> StepReport:
        a, step, scored, train_stats, sync = self.assignment, w.step, w.scored, w.trained, w.synced
        if self.stream:  # the engine calls of the window, and step k's own rollout latency
            rolled, prologue, rolled_step = self.stream.window_rollout(step, w.t0), None, step
        else:
            rolled = self.rollouts.get(step + 1) if step + 1 < self.cfg.steps else None
            prologue, rolled_step = self.rollouts.get(step), step + 1 if rolled else None
        t_end = time.time()
        if rolled is not None and not self.stream:
            self._concurrency(step, rolled, w.t0, t_end)
        c = self.timing.clock  # wall -> the run's seconds (emulated ones with cluster.emulate: emulate/clock.py)
        if self.stream:  # trained in parts as the step's samples arrived (driver/accumulate.py)
            train_s, train_busy, train_tail = self.stream.train_times(step, a.num_train)
        else:
            train_s = c.span(min(s["t0"] for s in train_stats), max(s["t1"] for s in train_stats))
            train_busy = sum(c.span(s["t0"], s["t1"]) for s in train_stats)
        sync_s = c.span(min(s["t0"] for s in sync), max(s["t1"] for s in sync)) if sync else 0.0
        for s in sync:
            self.rec.emit("span", device=s["device"], name="weight_sync", start_s=self.rel(s["t0"]),
                          end_s=self.rel(s["t1"]), step=step)
            if "wire_dtype" in s:  # an engine's load (roles/weight_sync.py Staging.record); the root's entry has none
                self.rec.emit("weight_sync", step=step, device=s["device"],
                              **{k: s[k] for k in ("wire_bytes", "wire_dtype", "staging_peak_bytes", "seconds",
                                                   "num_params", "num_buckets", "largest_bucket_bytes", "mode",
                                                   "changed_fraction", "refetched_buckets", "bucket_encodings")
                                 if k in s})
        rollout_s = c.span(rolled.t0, rolled.t1) if rolled else 0.0
        calls = rolled.calls if rolled else []
        rollout_work = sum(c.span(t0, t1) for _, t0, t1 in calls)
        busy = train_busy + rollout_work
        window = c.span(w.t0, t_end)
        tail_idle = sum(c.span(rolled.last_end[d], rolled.t1) for d in rolled.busy_s) if rolled else 0.0
        longest = max((c.span(t0, t1) for _, t0, t1 in calls), default=0.0)
        timing = self.timing.step(window_t0=w.t0, t_end=t_end, prologue=prologue, rolled=rolled,
                                  train_stats=train_stats, sync=sync, step=step,
                                  stage_calls=self.cluster.pacing.take_stage_calls())  # work, overhead (emulate/clock.py)
        report = StepReport(
            step=step, now_s=self.rel(t_end), num_rollout=a.num_rollout, num_train=a.num_train,
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, step_s=window,
            rollout_work_s=rollout_work, rollout_longest_s=longest,
            rollout_floor_s=longest, num_samples=len(scored.samples), response_tokens=scored.num_tokens,
            idle_device_s=max(0.0, a.num_devices * window - busy), tail_idle_device_s=tail_idle,
            resize_critical_s=self.last_critical_s, rollout_longest_tokens=scored.longest_tokens,
            **(self._stream_fields(step, scored, sync, train_tail) if self.stream else
               self._train_tokens(step, scored, rolled)))
        report = self.timing.report(report, rolled_step)
        self.last_critical_s = None
        self.stats["idle_device_s"] += report.idle_device_s
        self.stats["tail_idle_device_s"] += tail_idle
        self.rec.emit("step", step=step, t_start_s=self.rel(w.t0), t_end_s=self.rel(t_end),
                      rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, num_rollout=a.num_rollout,
                      num_train=a.num_train, idle_device_s=report.idle_device_s, tail_idle_device_s=tail_idle,
                      reward_mean=scored.mean_reward, response_tokens=scored.num_tokens, version=step + 1,
                      reward_std=scored.reward_std, reward_left_out=scored.left_out,
                      **({"reward_metrics": scored.reward_metrics} if scored.metric_values else {}),
                      **(scored.filtering or {}),
                      response_len_mean=scored.num_tokens / max(1, len(scored.samples)),
                      response_len_max=scored.longest_tokens,
                      rollout_work_s=report.rollout_work_s, rollout_longest_s=longest, param_sha1=w.digest,
                      **({"rollout_chunks": report.rollout_chunks} if self.stream else {}),
                      recoveries=w.recoveries, **train_fields(train_stats), **timing)
        return report

    def _concurrency(self, step: int, rolled: Any, t0: float, t1: float) -> None:
        """One-step-off: one `concurrency` record per rollout device for window `step`, from each
        request delivered in it (admitted at its call's start, finished at its last token)."""
        by_device: dict[int, list[tuple[float, float]]] = {}
        for device, admitted, finished in rolled.requests:
            by_device.setdefault(device, []).append((self.rel(admitted), self.rel(finished)))
        for device, spans in sorted(by_device.items()):
            self.rec.emit("concurrency", step=step, device=device,
                          **concurrency_summary(spans, self.rel(t0), self.rel(t1)))

    def _train_tokens(self, step: int, scored: ScoredStep, rolled: Any) -> dict:
        """One-step-off: the training demand, in sequence tokens, of the batch just trained and of
        the one the next step trains (rolled out in this window, so known before the decision)."""
        out = {"train_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in scored.samples)}
        if rolled is not None:
            kept = self.dyn.kept_ids(step + 1) if self.dyn else None  # dynamic sampling: the chosen groups'
            job = self.job
            out["next_train_tokens"] = sum(len(job.encode(job.prompt_record(step + 1, res.sample_id[1])))
                                           + len(res.response_ids) for _, res in rolled.results
                                           if kept is None or res.sample_id in kept)
        return out

    def _stream_fields(self, step: int, scored: ScoredStep, pulls: list[dict], train_tail: float) -> dict:
        """What the streaming throughput model reads (`policy.stream_model.StreamStageModel`): the
        step's response lengths, how many engine calls it was cut into, the device-seconds
        engines spent pulling weights in the window, and the training after its last sample."""
        c = self.timing.clock
        return {"response_lengths": tuple(len(s.response_ids) for s in scored.samples), "train_tail_s": train_tail,
                "rollout_chunks": self.stream.router.items_per_step.pop(step, 0),
                "rollout_sync_s": sum(c.span(p["t0"], p["t1"]) for p in pulls)}


def train_fields(stats: list[dict]) -> dict:
    """A step's training metrics for its record: the loss and its statistics (reduced over the
    trainers, so every trainer reports the same), and the largest state one trainer held."""
    first = stats[0]
    out = {k: first[k] for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "lr") if k in first}
    out["train_state_bytes_max"] = max(int(s.get("train_state_bytes", 0)) for s in stats)
    return out
