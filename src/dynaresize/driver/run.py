"""The real runtime: a disaggregated, one-step-off-policy GRPO job whose split follows the workload.

Top loop (`Run.run`), one window per step k:

    rollout(k+1) on the rollout pool  ||  train(k) on the training pool     (overlapped)
    -> weight sync of version k+1 to the rollout pool
    -> StepReport -> Controller.on_report -> resize plan (critical ops now, background later)

With `train.staleness = 0` the rollout of k+1 starts after the sync instead (synchronous).
With `train.staleness = eta >= 2` the window is driver/streaming.py's: rollout runs up to eta steps
ahead of training, requests in flight across windows (bounds stated there and in pipeline/streamplan.py).
The same `Controller` drives the simulator; both emit the same records (docs/records.md).

Semantics (README.md, "How it works") are kept by `Job` (what to generate and how to score is a
function of sample ids only) and proven by the `Ledger`, whose verdict is `ledger_ok`.

Faults (docs/faults.md): a window is a list of phases (`stepstate.Window`); a lost device interrupts
it with `DevicesLost`, `Recovery` re-forms the cluster on the survivors, restores the last full snapshot
(taken every K steps, off the step's path: driver/snapshots.py) and replays the steps since; the window
goes on with the phases not done. Checkpoints are written from full snapshots; `--resume` starts from one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dynaresize.cluster.cluster import Cluster, ResizeOutcome
from dynaresize.cluster.faults import parse_faults
from dynaresize.cluster.watchdog import DevicesLost
from dynaresize.config import RunConfig
from dynaresize.config_load import config_to_dict
from dynaresize.control.controller import Controller, decision_fields
from dynaresize.control.state import Refusal
from dynaresize.driver.checkpointing import (Checkpointer, ResumePoint, end_partial_line, resume_records,
                                             stream_versions)
from dynaresize.driver.console import progress_bar, say
from dynaresize.driver.dynamic_sampling import DynamicSampling
from dynaresize.driver.evaluation import Evaluator
from dynaresize.driver.job import Job, ScoredStep
from dynaresize.driver.ledger import Ledger, sample_record
from dynaresize.driver.recovery import Recovery, stop_run
from dynaresize.driver.snapshots import Snapshots
from dynaresize.driver.step_report import StepReporting
from dynaresize.emulate.clock import StepTiming
from dynaresize.emulate.model import run_bounds
from dynaresize.errors import RewardError
from dynaresize.metrics import resize_counts, throughput_fields
from dynaresize.pipeline.stepstate import StepRollout, Window, rollout_version
from dynaresize.policy.base import make_policy
from dynaresize.records import Recorder
from dynaresize.rl import grpo
from dynaresize.roles.base import auto_hf_reason, compute_dtype, resolve_engine
from dynaresize.tracking import check_backends, open_sinks
from dynaresize.types import ROLLOUT, TRAIN, Assignment, ResizePlan, StepReport

OP_EXTRAS = ("peak_staging_bytes", "kv_cache_bytes", "requests_moved")  # op-record fields only some ops have


class Run(StepReporting):
    """One job's driver state: records, ledger, controller, the device cluster and snapshots."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, progress: bool = True,
                 resume: ResumePoint | None = None) -> None:
        saved = resume.config["train"]["staleness"] if resume is not None else cfg.train.staleness
        if saved != cfg.train.staleness and max(saved, cfg.train.staleness) >= 2:
            from dynaresize.errors import ConfigError

            raise ConfigError([f"train.staleness={cfg.train.staleness}: the checkpoint's run streams with "
                               f"staleness {saved}; a streaming run resumes with the same staleness (docs/pipeline.md)"])
        self.job = Job(cfg)  # first: a bad prompt file, reward spec or fault spec stops here, nothing written
        self.evaluator = Evaluator(cfg, self.job)  # held-out prompts (eval.*): checked before anything is written
        parse_faults(cfg.faults, cfg.cluster.devices)
        check_backends(cfg.logging.backends)  # a tracker named but not installed: ConfigError, nothing written
        self.cfg, self.out, self.progress, self.resume = cfg, Path(out_dir), progress, resume
        state = resume.driver if resume else {}
        self.ledger: Ledger = state.get("ledger") or Ledger(staleness=cfg.train.staleness)
        self.controller, self.assignment = self._controller(state)
        self.start_step = resume.boundary if resume else 0
        self.rewards: list[float] = list(state.get("rewards", []))
        self.resizes: list[dict] = list(state.get("resizes", []))
        self.stats: dict = dict(state.get("stats") or {"faults_injected": 0, "faults_recovered": 0,
                                                        "recoveries": [], "elapsed_s": 0.0})
        for key in ("idle_device_s", "tail_idle_device_s"):  # sums of the step records' idle (metrics.py)
            self.stats.setdefault(key, 0.0)
        self.t0 = time.time() - self.stats["elapsed_s"]  # a resumed run's times go on from the checkpoint
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
        if resume:
            end_partial_line(self.out / "records.jsonl")
        self.rec = Recorder(self.out / "records.jsonl", sinks=open_sinks(cfg.logging.backends, self.out))
        self.rec.emit("config", config=config_to_dict(cfg))
        if resume:
            resume_records(self, resume)
        self.cluster = Cluster(cfg, on_event=self._on_event)
        self.timing = StepTiming(cfg, self.cluster.pacing.clock)  # emulated seconds, work and overhead
        self.snapshots = Snapshots(self)  # version -> trainer state (or weights only), by interval
        self.rollouts: dict[int, StepRollout] = {}
        self.pending: ResizeOutcome | None = None
        self.last_critical_s: float | None = None
        self.engine_version = rollout_version(self.start_step, cfg.train.staleness)  # what rollout devices hold
        self.recovery, self.ckpt = Recovery(self), Checkpointer(self)
        self.dyn = DynamicSampling(self) if cfg.algorithm.filter_groups else None  # DAPO's dynamic sampling
        self.stream = None
        if cfg.train.staleness >= 2:  # the streaming pipeline (driver/streaming.py)
            from dynaresize.driver.streaming import Streaming
            self.stream = Streaming(self)

    def _controller(self, state: dict) -> tuple[Controller, Assignment]:
        cfg = self.cfg
        same = state and (state["devices"], state["rollout_devices"], state["config"]["policy"]) == (
            cfg.cluster.devices, cfg.cluster.rollout_devices, config_to_dict(cfg)["policy"])
        if same:  # resumed on the same devices with the same policy: it goes on where it was
            return state["controller"], state["controller"].assignment
        bounds = run_bounds(cfg)  # the policy's limits (raised to an emulated accelerator's)
        # Streaming (staleness >= 2): hysteresis swaps its model for the throughput model.
        policy = make_policy(cfg.policy, bounds, num_steps=cfg.steps, staleness=max(cfg.train.staleness, 1))
        # A policy may name its split from step 0 (static:R, a scripted step-0 entry).
        start = None if state else getattr(policy, "start_rollout", None)
        assignment = Assignment.split(cfg.cluster.devices, cfg.cluster.rollout_devices if start is None else start)
        why = bounds.why_not(assignment.num_rollout)
        if why is not None:  # a config error, said before anything starts
            from dynaresize.errors import ConfigError

            raise ConfigError([f"cluster.rollout_devices={assignment.num_rollout}: the starting split breaks the "
                               f"policy's bounds ({why}; policy.min_rollout={cfg.policy.min_rollout}, "
                               f"policy.min_train={cfg.policy.min_train}, policy.move_unit={cfg.policy.move_unit}, "
                               f"rollout.tensor_parallel={cfg.rollout.tensor_parallel})"])
        controller = Controller(policy=policy, bounds=bounds, assignment=assignment)
        controller.continue_resize_ids(state.get("next_resize_id", 0))  # ids stay unique across a resume
        return controller, assignment

    def rel(self, t: float) -> float:
        return self.timing.clock.span(self.t0, t)

    def _on_event(self, kind: str, fields: dict) -> None:
        self.rec.emit(kind, **fields)

    # ------------------------------------------------------------------ the top loop

    def run(self) -> dict:
        bar = progress_bar(self.cfg.steps, self.progress, self.start_step)
        with self.cluster:
            self._start()
            w = Window(self.start_step)
            while w.step < self.cfg.steps:
                try:
                    self.stream.window(w) if self.stream else self._window(w)
                    if self.evaluator.due(w.step):  # between windows: the pipeline is drained (driver/evaluation.py)
                        if self.stream:
                            self.stream.before_eval(w.step)
                        self.evaluator.run(w.step, self.cluster, self.rec.emit, self.rel)
                    self.ckpt.periodic(w.step + 1)
                except DevicesLost as lost:
                    if self.stream:  # the router's requests in flight go back to its queue
                        self.stream.before_recovery()
                    self.recovery.recover(w, lost)  # or stops the run with a checkpoint (RunStopped)
                    if self.stream:
                        self.stream.after_recovery()
                    continue
                except RewardError as exc:
                    stop_run(self, w, f"step {w.step}: {exc}", trainers=self.assignment.devices(TRAIN))
                bar.update(1)
                bar.set_postfix(split=f"{self.assignment.num_rollout}R:{self.assignment.num_train}T",
                                reward=f"{w.scored.mean_reward:.3f}")
                w = Window(w.step + 1)
            self._finish_pending()
            self.ckpt.save(self.cfg.steps, "final")
            bar.close()
            return self._finish()

    def _start(self) -> None:
        self.cluster.start(self.assignment)
        v = self.start_step
        if self.resume:
            self.resume.load_into(self.cluster)
        self.snapshots.start(v, self.assignment.devices(TRAIN))
        rv = rollout_version(v, self.cfg.train.staleness)
        if rv != v:
            self.snapshots[rv] = self.resume.rollout_snapshot()
            for u in stream_versions(v, self.cfg.train.staleness):  # streaming: the steps in flight's
                self.snapshots[u] = self.resume.rollout_snapshot(u)
        if self.stream:
            self.stream.start()

    def _window(self, w: Window) -> None:
        cfg, step = self.cfg, w.step
        nxt = step + 1 < cfg.steps
        overlap = nxt and cfg.train.staleness >= 1
        self._prune(step)
        self._expect(step)
        if w.scored is None:
            w.scored = (self.dyn or self.job).score(step, self._rollout(step).results, self.ledger)
        if nxt:
            self._expect(step + 1)
        future = self._rollout_async(step + 1) if overlap else None
        try:
            if w.trained is None:
                w.trained = self._train(step, w.scored)
            self._finish_pending()
        finally:
            if future is not None:  # the sync needs the overlapped rollout done: its samples
                self.dyn.join(future, step + 1) if self.dyn else self._absorb(step + 1, future.result())
        self.cluster.raise_if_lost(f"step {step}")
        if w.synced is None:
            w.synced = self.cluster.sync_weights(version=step + 1, step=step)
            self.engine_version = step + 1
            w.digest = self.cluster.param_digest() if cfg.deterministic else None
            if w.digest is not None:
                self.cluster.check_engine_weights(w.digest, step + 1)
        if nxt and not overlap:
            self.dyn.complete(step + 1) if self.dyn else self._rollout(step + 1)
        if not w.reported:
            report = self._report(w)
            w.reported = True
            self._decide(step, report)

    # ------------------------------------------------------------------ pieces of a window

    def _expect(self, step: int) -> None:
        self.ledger.expect(step, self.job.expected_ids(step, self.dyn.batches(step) if self.dyn else 1))

    def _prune(self, step: int) -> None:
        """Snapshots of versions step-1 .. step+1 (streaming: from max(0, step-eta)) and rollouts of
        steps >= step are all a window needs."""
        self.snapshots.prune(min(step - 1, self.stream.keep_from(step)) if self.stream else step - 1)
        for s in [s for s in self.rollouts if s < step]:
            del self.rollouts[s]

    def _buffer(self, step: int) -> StepRollout:
        if step not in self.rollouts:
            self.rollouts[step] = StepRollout(step=step, remaining=self.job.requests(step))
        return self.rollouts[step]

    def _rollout(self, step: int) -> StepRollout:
        """The step's rollout, complete: sends what is left (nothing when done)."""
        buf = self._buffer(step)
        if not buf.done:
            self._engines_at(rollout_version(step, self.cfg.train.staleness))
            self._absorb(step, self.cluster.rollout(step, buf.remaining, self.assignment.devices(ROLLOUT)))
            self.cluster.raise_if_lost(f"rollout {step}")
        return buf

    def _rollout_async(self, step: int) -> Any:
        buf = self._buffer(step)
        if buf.done and not self.dyn:
            return None
        self._engines_at(rollout_version(step, self.cfg.train.staleness))  # dynamic sampling: every batch of it
        return self.dyn.complete_async(step) if self.dyn else self.cluster.rollout_async(step, buf.remaining)

    def _engines_at(self, version: int) -> None:
        self.snapshots.engines_at(version)

    def _absorb(self, step: int, outcome: Any) -> None:
        for sid in outcome.reissued:
            self.ledger.note_reissue(sid, f"device lost during rollout {step}: sent again, same id and seed")
        for d, t0, t1 in self._buffer(step).absorb(outcome):
            self.rec.emit("span", device=d, name="rollout", start_s=self.rel(t0), end_s=self.rel(t1))

    def _train(self, step: int, scored: ScoredStep) -> list[dict]:
        mbs = grpo.micro_batches(scored.samples, self.cfg.train.micro_batch_size)
        total = grpo.total_response_tokens(scored.samples)
        return self._trained(step, scored, self.cluster.train(step, mbs, total,
                                                              snapshot=self.snapshots.request(step + 1)))

    def _trained(self, step: int, scored: ScoredStep, stats: list[dict]) -> list[dict]:
        """After step `step`'s optimizer step: snapshot of version step+1 started (not waited for), the
        step kept for a replay (so its state is safe: consumed now), ledger, spans (driver/snapshots.py)."""
        self.snapshots.after_train(step, stats, scored)
        self.snapshots.begin(step + 1, self.assignment.devices(TRAIN))
        for s in scored.samples:
            self.ledger.consumed(s.sample_id, step)
            self.rec.emit("sample", **sample_record(self.ledger.entries[s.sample_id]))
        self.rewards.append(scored.mean_reward)
        for st in stats:
            d = st["device"]
            self.rec.emit("span", device=d, name="train", start_s=self.rel(st["t0"]), end_s=self.rel(st["t1"]), step=step)
            self.rec.emit("span", device=d, name="train:fwd_bwd", start_s=self.rel(st["t0"]),
                          end_s=self.rel(st["t_grads"]), step=step, cat="train")
            if st["t_wait"] - st["t_grads"] > 1e-4:
                self.rec.emit("span", device=d, name="train:wait_moments", start_s=self.rel(st["t_grads"]),
                              end_s=self.rel(st["t_wait"]), step=step, cat="train")
        return stats

    def _decide(self, step: int, report: StepReport) -> None:
        commands = self.controller.on_report(report)
        self.rec.emit("decision", step=step, **decision_fields(self.controller),
                      state=str(self.controller.state.value))
        for cmd in commands:
            if isinstance(cmd, Refusal):
                self.rec.emit("refused", step=step, requested_rollout=cmd.requested_rollout, reason=cmd.reason)
                say(f"dynaresize: resize refused at step {step}: {cmd.requested_rollout} rollout devices "
                    f"({cmd.reason}); the run goes on at {self.assignment.num_rollout}")
            elif isinstance(cmd, ResizePlan) and step + 1 < self.cfg.steps:
                self._resize(step, cmd)
            elif isinstance(cmd, ResizePlan):
                self.controller.on_resize_done(cmd.resize_id, 0.0, 0.0)  # the run ends: nothing to move

    def _resize(self, step: int, plan: ResizePlan) -> None:
        self.snapshots.settle()  # the copies read the trainers' state before the reshard moves it
        outcome = self.cluster.resize(plan, version=step + 1, step=step,
                                      background_moments=self.cfg.reshard.background_moments)
        if self.stream:
            self.stream.after_resize(plan, version=step + 1)
        self.assignment = plan.dst
        critical_s = self.timing.clock.span(outcome.t_decide, outcome.critical_end)
        self.timing.on_resize(outcome)
        self.last_critical_s = critical_s
        self.controller.on_resize_done(plan.resize_id, critical_s, critical_s)
        self.pending = outcome

    def _finish_pending(self) -> None:
        """Record a resize once its background ops (overlapped with the next step) are done."""
        if self.pending is None:
            return
        o, self.pending = self.pending, None
        self.cluster.finish_background(o)
        plan, ids = o.plan, self.cluster.ids
        for op in o.ops:
            self.rec.emit("op", resize_id=plan.resize_id, name=op["name"], device=op["device"],
                          start_s=self.rel(op["t0"]), end_s=self.rel(op["t1"]), bytes=op["bytes"],
                          critical=op["critical"], **{k: op[k] for k in OP_EXTRAS if k in op})
        total_end = max(op["t1"] for op in o.ops)
        as_ids = lambda a: {k: [ids[r] for r in v] for k, v in a.to_json().items()}  # noqa: E731
        moved = [op["requests_moved"] for op in o.ops if "requests_moved" in op]  # migrate_requests ops
        rec = self.rec.emit("resize", resize_id=plan.resize_id, step=plan.step, **{"from": as_ids(plan.src)},
                            to=as_ids(plan.dst), moving=[ids[r] for r in plan.moving], to_role=plan.to_role,
                            critical_s=self.timing.clock.span(o.t_decide, o.critical_end),
                            total_s=self.timing.clock.span(o.t_decide, total_end),
                            t_s=self.rel(o.t_decide), groups_created_critical=o.groups_created_critical,
                            reason=plan.reason, **({"requests_moved": sum(moved)} if moved else {}))
        self.resizes.append(rec)

    # ------------------------------------------------------------------ outputs

    def _finish(self, stopped: str | None = None) -> dict:
        from dynaresize.report.timeline import write_timeline
        from dynaresize.report.trace import write_trace

        total_s = time.time() - self.t0
        comm = [] if stopped else self.cluster.comm_stats()
        if not stopped:
            self._save_hf()
        self.snapshots.finish(settle=not stopped)  # a stopped run: the records of what was collected
        problems = self.ledger.check()
        k = max(1, min(2, len(self.rewards) // 2))
        consumed = sum(1 for e in self.ledger.entries.values() if e.consumed_step is not None)
        s = self.stats
        summary = {
            "steps": self.cfg.steps, "devices": self.cfg.cluster.devices,
            "reward_first": sum(self.rewards[:k]) / k, "reward_last": sum(self.rewards[-k:]) / k,
            "reward_by_step": self.rewards, "ledger_ok": not problems, "ledger_problems": problems[:20],
            "world_inits_max": max((c.get("world_inits", 0) for c in comm), default=0),
            "groups_created": comm[0].get("groups_created", 0) if comm else 0,
            "groups_created_critical": comm[0].get("groups_created_critical", 0) if comm else 0,
            "rollout_devices_final": self.assignment.num_rollout, "policy": self.cfg.policy.name,
            "devices_final": self.assignment.num_devices, "world_generation": self.cluster.generation,
            "faults_injected": s["faults_injected"] + self.cluster.faults.num_fired,
            "faults_recovered": s["faults_recovered"], "recoveries": s["recoveries"],
            "faults_unfired": self.cluster.faults.unfired(),
            "resumed_from_step": self.start_step if self.resume else None, "stopped": stopped,
            "rollout_engine": resolve_engine(self.cfg), "train_dtype": compute_dtype(self.cfg, cuda=self.cluster.cuda),
            "staleness": self.cfg.train.staleness,
            "max_staleness": max((e.consumed_step - e.version for e in self.ledger.entries.values()
                                  if e.consumed_step is not None), default=None),
            "rollout_engine_why": auto_hf_reason(self.cfg) if self.cfg.rollout.engine == "auto" else None,
            "eval": self.evaluator.last, **self.snapshots.summary(),
        }
        timing = self.timing.summary(total_s)  # time unit, overhead, overruns (emulate/clock.py)
        # Emulated: the steps' emulated seconds (startup left out), the time the simulator predicts.
        summary.update(throughput_fields(num_devices=self.cfg.cluster.devices,
                                         total_time_s=timing.pop("steps_total_s", None) or total_s,
                                         num_samples=consumed, idle_device_s=s["idle_device_s"],
                                         tail_idle_device_s=s["tail_idle_device_s"]),
                       **resize_counts(r["to_role"] for r in self.resizes), **timing)
        self.rec.emit("summary", summary=summary)
        self.rec.close()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        records = [json.loads(line) for line in (self.out / "records.jsonl").read_text().splitlines() if line.strip()]
        write_timeline(records, self.out / "timeline.png", title=f"dynaresize run ({self.cfg.policy.name})")
        write_trace(records, self.out / "trace.json")
        return summary

    def _save_hf(self) -> None:
        """The final weights as an HF folder (tied embeddings stay tied: one tensor, saved once),
        gathered and written on the first trainer (driver/checkpointing.py `export_hf`)."""
        from dynaresize.driver.checkpointing import export_hf

        export_hf(self, self.out / "checkpoint")


def run_job(cfg: RunConfig, out_dir: str | Path, *, progress: bool = True, resume: ResumePoint | None = None) -> dict:
    """Run the job of `cfg` (or resume the run in `out_dir`), write its run directory, return its summary."""
    return Run(cfg, out_dir, progress=progress, resume=resume).run()
