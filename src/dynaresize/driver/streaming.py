"""The streaming pipeline on the real runtime: `train.staleness = eta >= 2` (docs/pipeline.md).

Window k of `Run.run` under streaming (the one-step-off window is `Run._window`):

    release the steps whose weights exist (s <= k + eta, streamplan.released_through)
    -> the router generates steps k .. k+eta (a driver thread)  ||  the trainers train step k
       as its samples arrive: each prompt group scored once complete, each micro-batch trained
       once its groups are (forward/backward, gradient accumulated), the optimizer step after
       the last one (driver/accumulate.py: the update equals training the whole step at once)
    -> version k+1 exists (snapshot, and its digest in deterministic mode)
    -> StepReport -> Controller.on_report -> resize plan

Requests stay in flight across windows: nothing waits for a step's longest response except
the training of that very step. The router drives each engine request by request
(cluster/router.py): a step is cut into shares of consecutive samples, and an engine admits
the next share of the version it holds as its slots free (up to `rollout.vllm_max_num_seqs`
requests) or once everything it runs is in its tail. Which weights generate a sample depends only on its step
(version max(0, s - eta)), so a run with resizes equals a static run with the same eta, except
under partial rollout (`rollout.partial`), where a running request goes on under newer weights
and its tokens come from a range of versions (the sample records them; the oldest is within
the bound; not deterministic, which the config refuses together).

Bounds (pipeline/streamplan.py states and checks them): in window k at most eta+1 steps are in rollout
(k .. k+eta) and buffered unconsumed; engines generate with versions max(0, k-eta) .. k; the
driver keeps the weights of versions max(0, k-eta) .. k+1.

Dynamic sampling (`algorithm.filter_groups`, driver/dynamic_sampling.py): the window that
trains step k scores its groups as they arrive and, while it has too few kept groups, releases
the step's next generation batch (`StreamRouter.release_more`: ahead of later steps' items,
under step k's version); the step is trained in one part once filtered.

Resizes (the same controller, plan and ops): an engine leaving the rollout pool hands its
requests in flight to the remaining replicas in the plan's `migrate_requests` op (same sample
ids and seeds; with their prefix under partial rollout); the resize record counts them
(`requests_moved`), and the move never waits for them to finish. An engine joining holds the
version its trainers just made (k+1) and pulls another one when its first item needs it.
Each window also records, per rollout device, its requests in flight over time
(`concurrency` records, a figure in `dynaresize report`).

Faults and node loss (driver/recovery.py, as one-step-off): the router puts every request not
yet delivered back in the queue (`before_recovery`), the survivors re-form and get the trainer
state of the last snapshot, and the window goes on where it stood: delivered samples are kept,
the rest re-issued with their ids and seeds and the version of their step; a step being
trained starts over from the restored state with its samples already scored.
Checkpoints (driver/checkpointing.py) hold the weight versions the steps in flight need and the
samples they already have; `--resume` keeps those samples and re-issues the rest.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dynaresize.cluster.router import WAKE_S, StreamRouter
from dynaresize.driver.accumulate import StepAccumulator
from dynaresize.pipeline.concurrency import concurrency_summary
from dynaresize.pipeline.stepstate import StepRollout, Window
from dynaresize.pipeline.streamplan import released_through
from dynaresize.rl import grpo
from dynaresize.types import ROLLOUT, ResizePlan


class Streaming:
    """The streaming side of one `Run` (see the module docstring)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.eta = run.cfg.train.staleness
        self.digests: dict[int, str] | None = {} if run.cfg.deterministic else None
        self.router = StreamRouter(run.cluster, self.eta, run.rollouts, weights=lambda v: run.snapshots[v],
                                   digests=self.digests, partial=run.cfg.rollout.partial)
        run.cluster.migrator = self.router.migrate  # the plan's migrate_requests op (cluster.py)
        self.window_calls: list[tuple[int, float, float]] = []
        self.expected: dict[int, list] = {}  # released step -> its sample ids
        self.accs: dict[int, StepAccumulator] = {}  # step being trained -> its samples (kept across a recovery)
        self.train_parts: dict[int, list[tuple[float, float]]] = {}  # step -> (t0, t1) of each training call

    def start(self) -> None:
        """Engines hold version 0 (`Cluster.start`), or on a resume the checkpoint's oldest
        (`run.engine_version`), with the samples the checkpoint kept; the trainers' digest of
        their version for the pull checks (a resumed run's older versions are not checked)."""
        run = self.run
        self.router.set_engines(run.assignment.devices(ROLLOUT), run.engine_version)
        if self.digests is not None:
            self.digests[run.start_step] = run.cluster.param_digest()
        if run.resume is not None:
            for s, results in sorted(run.resume.stream_samples.items()):
                run.rollouts[s] = StepRollout(step=s, remaining=[], results=list(results), t0=time.time())

    def keep_from(self, step: int) -> int:
        """The oldest weight version window `step` may still need (its own step's)."""
        return max(0, step - self.eta)

    # ------------------------------------------------------------------ one window

    def window(self, w: Window) -> None:
        run, router, step = self.run, self.router, w.step
        last = released_through(step, self.eta, run.cfg.steps)
        for s in range(step, last + 1):
            if not router.queue.released(s):
                run._expect(s)
                groups = run.job.requests(s)
                self.expected[s] = [r.sample_id for g in groups for r in g]
                kept = {tuple(res.sample_id) for _, res in run.rollouts[s].results} if s in run.rollouts else set()
                groups = [g for g in ([r for r in g if tuple(r.sample_id) not in kept] for g in groups) if g]
                router.release(s, groups)  # a resumed run re-issues only what its checkpoint did not keep
        router.queue.forget_before(step)
        problems = router.queue.check_bounds(step)
        if problems:
            raise RuntimeError(f"streaming window {step}: " + "; ".join(problems))
        stop = threading.Event()
        future = run.cluster.submit(router.pump, stop.is_set, f"rollout in window {step}", stop.wait)
        try:
            if w.trained is None:
                w.scored, stats = self._accumulate(step, future)
                w.trained = run._trained(step, w.scored, stats)
            run._finish_pending()
        finally:
            stop.set()
            future.result()
        self._spans()
        self._concurrency(step, w.t0)
        run.cluster.raise_if_lost(f"step {step}")
        if w.synced is None:
            if self.digests is not None:
                w.digest = self.digests[step + 1] = run.cluster.param_digest()
            w.synced = router.take_pulls()  # the engines' weight pulls of this window
        if not w.reported:
            report = run._report(w)
            w.reported = True
            run._decide(step, report)

    def _accumulate(self, step: int, pump: Any) -> tuple[Any, list[dict]]:
        """Train step `step` while the router (the `pump` thread) generates it: score each prompt
        group once complete, hand each micro-batch to the trainers once its groups are scored,
        the optimizer step with the last one. Returns the scored step and the last call's stats."""
        run = self.run
        if run.dyn is not None:  # dynamic sampling: the step's groups are known once filtered
            return self._filtered(step, pump)
        acc = self.accs.get(step)
        if acc is None:
            acc = self.accs[step] = StepAccumulator(step, self.expected.pop(step),
                                                    micro_batch_size=run.cfg.train.micro_batch_size,
                                                    samples_per_prompt=run.cfg.rollout.samples_per_prompt)
        else:  # again after a recovery: the trainers start the step over from the restored state
            acc.restart()
        buf, parts, first = run.rollouts[step], [], True
        while True:
            if pump.done():  # the router's thread ended before step `step` was in: its error
                pump.result()
                raise RuntimeError(f"streaming window {step}: the rollout thread stopped early")
            for group in acc.complete_groups(buf.results):
                acc.add_scored(run.job.score(step, group, run.ledger))
            ready = acc.take_ready()
            if not ready:
                time.sleep(WAKE_S)
                continue
            last = acc.done
            out = run.cluster.train_part(step, ready, begin=first, num_micro_batches=acc.num_micro_batches,
                                         total_tokens=acc.total_tokens if last else None,
                                         snapshot=run.snapshots.request(step + 1) if last else None)
            first = False
            parts.append((min(o["t0"] for o in out), max(o["t1"] for o in out)))
            if last:
                self.train_parts[step] = parts
                del self.accs[step]
                return acc.scored_step(), out
            for o in out:  # the last call's spans come with the step's (`Run._trained`)
                run.rec.emit("span", device=o["device"], name="train", start_s=run.rel(o["t0"]),
                             end_s=run.rel(o["t1"]), step=step)

    def _filtered(self, step: int, pump: Any) -> tuple[Any, list[dict]]:
        """Step `step` under dynamic sampling (driver/dynamic_sampling.py): score each prompt
        group once complete, release the step's next generation batch to the router (ahead of
        later steps, under the step's own weight version) while fewer than P groups are kept and
        every issued group is scored; then train the kept groups in one part."""
        run, dyn = self.run, self.run.dyn
        self.expected.pop(step, None)
        k = run.cfg.rollout.samples_per_prompt
        while True:
            if pump.done():  # the router's thread ended before step `step` was in: its error
                pump.result()
                raise RuntimeError(f"streaming window {step}: the rollout thread stopped early")
            st = dyn.state(step)
            groups: dict = {}
            for d, res in run.rollouts[step].results:
                if res.sample_id not in st.scored_ids:
                    groups.setdefault(res.sample_id[1], []).append((d, res))
            new = [x for g in groups.values() if len(g) == k for x in g]
            if new:
                dyn.add_part(step, new)
            issued = st.filter.batches * run.job.gen_prompts
            if len(st.filter.seen) < issued:  # the issued batches are not all in yet
                if not new:
                    time.sleep(WAKE_S)
                continue
            if st.filter.full:
                break
            dyn.next_batch(step, lambda groups: self.router.release_more(step, groups))
        scored = dyn.scored(step)
        mbs = grpo.micro_batches(scored.samples, run.cfg.train.micro_batch_size)
        out = run.cluster.train_part(step, list(enumerate(mbs)), begin=True, num_micro_batches=len(mbs),
                                     total_tokens=grpo.total_response_tokens(scored.samples),
                                     snapshot=run.snapshots.request(step + 1))
        self.train_parts[step] = [(min(o["t0"] for o in out), max(o["t1"] for o in out))]
        return scored, out

    def train_times(self, step: int, num_train: int) -> tuple[float, float, float]:
        """(training seconds, training device-seconds, seconds trained after the step's last
        sample) of step `step`: its calls' spans summed, times the trainers, and from its last
        sample (or its first call, if later) to its optimizer step's end."""
        c, parts = self.run.timing.clock, self.train_parts.pop(step)
        train_s = sum(c.span(t0, t1) for t0, t1 in parts)
        buf = self.run.rollouts.get(step)
        done = buf.t1 if buf is not None and buf.t1 else parts[-1][0]
        return train_s, train_s * num_train, c.span(max(done, parts[0][0]), parts[-1][1])

    def _concurrency(self, step: int, window_t0: float) -> None:
        """One `concurrency` record per rollout device: its requests in flight in this window."""
        run, now = self.run, time.time()
        t0, t1 = run.rel(window_t0), run.rel(now)
        for dev, spans in sorted(self.router.take_concurrency(window_t0, now).items()):
            summary = concurrency_summary([(run.rel(a), run.rel(b)) for a, b in spans], t0, t1)
            run.rec.emit("concurrency", step=step, device=dev, **summary)

    def _spans(self) -> None:
        run = self.run
        for d, step, t0, t1 in self.router.take_calls():
            self.window_calls.append((d, t0, t1))
            run.rec.emit("span", device=d, name="rollout", start_s=run.rel(t0), end_s=run.rel(t1), step=step)

    def window_rollout(self, step: int, window_t0: float) -> StepRollout:
        """What the report of window `step` says of rollout: the engine calls that ended in the
        window (clipped to its start), and step `step`'s latency (release to last response).
        Tail idle is 0 by definition: an engine that finished its share takes the next one."""
        calls = [(d, max(t0, window_t0), t1) for d, t0, t1 in self.window_calls if t1 > window_t0]
        self.window_calls = []
        buf = self.run.rollouts.get(step)
        return StepRollout(step=step, remaining=[], calls=calls, t0=buf.t0 if buf else window_t0,
                           t1=buf.t1 if buf and buf.t1 else window_t0)

    # ------------------------------------------------------------------ resizes and evaluation

    def before_recovery(self) -> None:
        """Devices were lost: every request not delivered goes back to the queue (router.abandon)."""
        self._spans()
        for sid in self.router.abandon():
            self.run.ledger.note_reissue(sid, "its device was lost (in flight)")

    def after_recovery(self) -> None:
        """The survivors' rollout devices hold `run.engine_version` (recovery restored it)."""
        run = self.run
        self.router.set_engines(run.assignment.devices(ROLLOUT), run.engine_version)

    def after_resize(self, plan: ResizePlan, version: int) -> None:
        left = [d for d in plan.src.devices(ROLLOUT) if d not in plan.dst.devices(ROLLOUT)]
        joined = [d for d in plan.dst.devices(ROLLOUT) if d not in plan.src.devices(ROLLOUT)]
        self.router.remove_engines(left)
        self.router.set_engines(joined, version)  # load_weights gave them the trainers' version

    def before_eval(self, step: int) -> None:
        """Evaluation after step `step` sees version step+1 on every engine: drain them all,
        pull it; the router pulls each later item's own version again (deterministic)."""
        devices = list(self.run.assignment.devices(ROLLOUT))
        self.router.drain(devices)
        self._spans()
        self.router.pull_all(step + 1)
