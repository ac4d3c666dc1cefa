"""The real runtime: a disaggregated, one-step-off-policy GRPO job whose split follows the workload.

Top loop (`run_job`), one window per step k:

    rollout(k+1) on the rollout pool  ||  train(k) on the training pool     (overlapped)
    -> weight sync of version k+1 to the rollout pool
    -> StepReport -> Controller.on_report -> resize plan (critical ops now, background later)

With `train.staleness = 0` the rollout of k+1 starts after the sync instead (synchronous).
The same `Controller` drives the simulator; both emit the same records (docs/records.md).

Semantics (DESIGN.md section 3) are kept by `Job` (what to generate and how to score is a
function of sample ids only) and proven by the `Ledger`, whose verdict is `ledger_ok`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dynaresize.cluster.cluster import Cluster, ResizeOutcome, RolloutOutcome
from dynaresize.config import RunConfig, config_to_dict
from dynaresize.control.controller import Controller, decision_fields
from dynaresize.control.state import Refusal
from dynaresize.job import Job, ScoredStep
from dynaresize.ledger import Ledger, sample_record
from dynaresize.policy.base import make_policy
from dynaresize.records import Recorder
from dynaresize.rl import grpo
from dynaresize.types import ROLLOUT, TRAIN, Assignment, Bounds, ResizePlan, StepReport


class Run:
    """One job's driver state: records, ledger, controller and the device cluster."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, progress: bool = True) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
        self.rec = Recorder(self.out / "records.jsonl")
        self.rec.emit("config", config=config_to_dict(cfg))
        self.t0 = time.time()
        self.job = Job(cfg)
        self.ledger = Ledger(staleness=cfg.train.staleness)
        bounds = Bounds(num_devices=cfg.cluster.devices, min_rollout=cfg.policy.min_rollout,
                        min_train=cfg.policy.min_train, move_unit=cfg.policy.move_unit)
        policy = make_policy(cfg.policy, bounds, num_steps=cfg.steps)
        # A policy may name its split from step 0 (static:R, a scripted step-0 entry).
        start = getattr(policy, "start_rollout", None)
        self.assignment = Assignment.split(cfg.cluster.devices, cfg.cluster.rollout_devices if start is None else start)
        self.controller = Controller(policy=policy, bounds=bounds, assignment=self.assignment)
        self.cluster = Cluster(cfg, on_event=self._on_event)
        self.progress = progress
        self.rewards: list[float] = []
        self.resizes: list[dict] = []
        self.pending: ResizeOutcome | None = None
        self.last_critical_s: float | None = None

    def rel(self, t: float) -> float:
        return t - self.t0

    def _on_event(self, kind: str, fields: dict) -> None:
        self.rec.emit(kind, **fields)

    # ------------------------------------------------------------------ the top loop

    def run(self) -> dict:
        cfg = self.cfg
        bar = _progress(cfg.steps, self.progress)
        with self.cluster:
            self.cluster.start(self.assignment)
            self._expect(0)
            rolled = self.cluster.rollout(0, self.job.requests(0), self.assignment.devices(ROLLOUT))
            self._spans_rollout(rolled)
            for step in range(cfg.steps):
                window_t0 = time.time()
                scored = self.job.score(step, rolled.results, self.ledger)
                nxt = step + 1 < cfg.steps
                if nxt:
                    self._expect(step + 1)
                overlap = nxt and cfg.train.staleness >= 1
                future = self.cluster.rollout_async(step + 1, self.job.requests(step + 1)) if overlap else None
                train_stats = self._train(step, scored)
                self._finish_pending()
                # The sync waits for the overlapped rollout: its samples must all come from the
                # weights it started with (version step), whatever device finishes last.
                next_rolled = future.result() if overlap else None
                sync = self.cluster.sync_weights(version=step + 1, step=step)
                digest = self.cluster.param_digest() if cfg.deterministic else None
                if nxt and not overlap:
                    next_rolled = self.cluster.rollout(step + 1, self.job.requests(step + 1),
                                                       self.assignment.devices(ROLLOUT))
                report = self._report(step, window_t0, scored, train_stats, sync, next_rolled, digest)
                self._decide(step, report)
                if next_rolled is not None:
                    self._spans_rollout(next_rolled)
                    rolled = next_rolled
                bar.update(1)
                bar.set_postfix(split=f"{self.assignment.num_rollout}R:{self.assignment.num_train}T",
                                reward=f"{scored.mean_reward:.3f}")
            self._finish_pending()
            bar.close()
            return self._finish()

    # ------------------------------------------------------------------ pieces of a window

    def _expect(self, step: int) -> None:
        self.ledger.expect(step, self.job.expected_ids(step))

    def _train(self, step: int, scored: ScoredStep) -> list[dict]:
        mbs = grpo.micro_batches(scored.samples, self.cfg.train.micro_batch_size)
        total = grpo.total_response_tokens(scored.samples)
        stats = self.cluster.train(step, mbs, total)
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

    def _spans_rollout(self, rolled: RolloutOutcome) -> None:
        for d, t0, t1 in rolled.calls:
            self.rec.emit("span", device=d, name="rollout", start_s=self.rel(t0), end_s=self.rel(t1))

    def _report(self, step: int, window_t0: float, scored: ScoredStep, train_stats: list[dict],
                sync: list[dict], rolled: RolloutOutcome | None, digest: str | None = None) -> StepReport:
        a = self.assignment
        t_end = time.time()
        train_t0 = min(s["t0"] for s in train_stats)
        train_s = max(s["t1"] for s in train_stats) - train_t0
        sync_s = (max(s["t1"] for s in sync) - min(s["t0"] for s in sync)) if sync else 0.0
        for s in sync:
            self.rec.emit("span", device=s["device"], name="weight_sync", start_s=self.rel(s["t0"]),
                          end_s=self.rel(s["t1"]), step=step)
        rollout_s = (rolled.t1 - rolled.t0) if rolled else 0.0
        busy = sum(s["t1"] - s["t0"] for s in train_stats) + (sum(rolled.busy_s.values()) if rolled else 0.0)
        window = t_end - window_t0
        tail_idle = sum(rolled.t1 - rolled.last_end[d] for d in rolled.busy_s) if rolled else 0.0
        longest = max((t1 - t0 for _, t0, t1 in rolled.calls), default=0.0) if rolled else 0.0
        report = StepReport(
            step=step, now_s=self.rel(t_end), num_rollout=a.num_rollout, num_train=a.num_train,
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, step_s=window,
            rollout_work_s=sum(rolled.busy_s.values()) if rolled else 0.0, rollout_longest_s=longest,
            rollout_floor_s=longest, num_samples=len(scored.samples), response_tokens=scored.num_tokens,
            idle_device_s=max(0.0, a.num_devices * window - busy), tail_idle_device_s=tail_idle,
            resize_critical_s=self.last_critical_s, rollout_longest_tokens=scored.longest_tokens)
        self.last_critical_s = None
        self.rec.emit("step", step=step, t_start_s=self.rel(window_t0), t_end_s=self.rel(t_end),
                      rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, num_rollout=a.num_rollout,
                      num_train=a.num_train, idle_device_s=report.idle_device_s, tail_idle_device_s=tail_idle,
                      reward_mean=scored.mean_reward, response_tokens=scored.num_tokens, version=step + 1,
                      rollout_work_s=report.rollout_work_s, rollout_longest_s=longest, param_sha1=digest)
        return report

    def _decide(self, step: int, report: StepReport) -> None:
        commands = self.controller.on_report(report)
        self.rec.emit("decision", step=step, **decision_fields(self.controller),
                      state=str(self.controller.state.value))
        for cmd in commands:
            if isinstance(cmd, Refusal):
                self.rec.emit("refused", step=step, requested_rollout=cmd.requested_rollout, reason=cmd.reason)
            elif isinstance(cmd, ResizePlan) and step + 1 < self.cfg.steps:
                self._resize(step, cmd)
            elif isinstance(cmd, ResizePlan):
                self.controller.on_resize_done(cmd.resize_id, 0.0, 0.0)  # the run ends: nothing to move

    def _resize(self, step: int, plan: ResizePlan) -> None:
        outcome = self.cluster.resize(plan, version=step + 1, step=step, 
                                      background_moments=self.cfg.reshard.background_moments)
        self.assignment = plan.dst
        critical_s = outcome.critical_end - outcome.t_decide
        self.last_critical_s = critical_s
        self.controller.on_resize_done(plan.resize_id, critical_s, critical_s)
        self.pending = outcome

    def _finish_pending(self) -> None:
        """Record a resize once its background ops (overlapped with the next step) are done."""
        if self.pending is None:
            return
        o, self.pending = self.pending, None
        self.cluster.finish_background(o)
        plan = o.plan
        for op in o.ops:
            self.rec.emit("op", resize_id=plan.resize_id, name=op["name"], device=op["device"],
                          start_s=self.rel(op["t0"]), end_s=self.rel(op["t1"]), bytes=op["bytes"],
                          critical=op["critical"])
        total_end = max(op["t1"] for op in o.ops)
        rec = self.rec.emit("resize", resize_id=plan.resize_id, step=plan.step, **{"from": plan.src.to_json()},
                            to=plan.dst.to_json(), moving=list(plan.moving), to_role=plan.to_role,
                            critical_s=o.critical_end - o.t_decide, total_s=total_end - o.t_decide,
                            t_s=self.rel(o.t_decide), groups_created_critical=o.groups_created_critical,
                            reason=plan.reason)
        self.resizes.append(rec)

    # ------------------------------------------------------------------ outputs

    def _finish(self) -> dict:
        from dynaresize.report.timeline import write_timeline
        from dynaresize.report.trace import write_trace

        total_s = time.time() - self.t0
        comm = self.cluster.comm_stats()
        self._save_hf()
        problems = self.ledger.check()
        k = max(1, min(2, len(self.rewards) // 2))
        summary = {
            "steps": self.cfg.steps, "devices": self.cfg.cluster.devices, "total_time_s": total_s,
            "samples_per_s": sum(1 for e in self.ledger.entries.values() if e.consumed_step is not None) / total_s,
            "resizes": len(self.resizes),
            "resizes_to_rollout": sum(1 for r in self.resizes if r["to_role"] == ROLLOUT),
            "resizes_to_train": sum(1 for r in self.resizes if r["to_role"] == TRAIN),
            "reward_first": sum(self.rewards[:k]) / k, "reward_last": sum(self.rewards[-k:]) / k,
            "reward_by_step": self.rewards, "ledger_ok": not problems, "ledger_problems": problems[:20],
            "world_inits_max": max(c.get("world_inits", 0) for c in comm),
            "groups_created": comm[0].get("groups_created", 0),
            "groups_created_critical": comm[0].get("groups_created_critical", 0),
            "rollout_devices_final": self.assignment.num_rollout, "policy": self.cfg.policy.name,
        }
        self.rec.emit("summary", summary=summary)
        self.rec.close()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        records = [json.loads(line) for line in (self.out / "records.jsonl").read_text().splitlines()]
        write_timeline(records, self.out / "timeline.png", title=f"dynaresize run ({self.cfg.policy.name})")
        write_trace(records, self.out / "trace.json")
        return summary

    def _save_hf(self) -> None:
        import ray

        from dynaresize.rl.models import build_model, save_hf

        state = ray.get(self.cluster.trainer().full_weights.remote())
        model = build_model(self.cfg.model)
        model.load_state_dict(state, strict=True)
        save_hf(model, self.job.tokenizer, self.out / "checkpoint")


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="dynaresize run", unit="step", disable=not enabled, dynamic_ncols=True)


def run_job(cfg: RunConfig, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Run the job of `cfg`, write its run directory, return its summary."""
    return Run(cfg, out_dir, progress=progress).run()
