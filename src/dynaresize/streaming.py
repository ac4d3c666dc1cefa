"""The streaming pipeline on the real runtime: `train.staleness = eta >= 2` (docs/pipeline.md).

Window k of `Run.run` under streaming (the one-step-off window is `Run._window`):

    release the steps whose weights exist (s <= k + eta, streamplan.released_through)
    -> pump the router until step k's samples are all in; score step k
    -> train step k  ||  the router keeps generating steps k+1 .. k+eta     (overlapped)
    -> version k+1 exists (snapshot, and its digest in deterministic mode)
    -> StepReport -> Controller.on_report -> resize plan

Requests stay in flight across windows: nothing waits for a step's longest response except
the training of that very step. Which weights generate a sample depends only on its step
(version max(0, s - eta)), so a run with resizes equals a static run with the same eta.

Bounds (streamplan.py states and checks them): in window k at most eta+1 steps are in rollout
(k .. k+eta) and buffered unconsumed; engines generate with versions max(0, k-eta) .. k, one at
a time each; the driver keeps the weights of versions max(0, k-eta) .. k+1.

Resizes (the same controller, plan and ops): an engine leaving the rollout pool is drained
first (nothing new is routed to it; the other engines go on; the wait is the resize record's
`drain_s`), so no request is in flight on it when the plan's ops run. An engine joining holds
the version its trainers just made (k+1) and pulls another one when its first item needs it.

Not supported under streaming (refused as config errors naming `train.staleness`, exit 2):
faults (recovery) and periodic checkpoints; `--resume` of a streaming run is refused too. A
device lost anyway stops the run cleanly (recovery.stop_run).
"""

from __future__ import annotations

import threading
from typing import Any

from dynaresize.cluster.router import StreamRouter
from dynaresize.stepstate import StepRollout, Window
from dynaresize.streamplan import released_through
from dynaresize.types import ROLLOUT, ResizePlan


class Streaming:
    """The streaming side of one `Run` (see the module docstring)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.eta = run.cfg.train.staleness
        self.digests: dict[int, str] | None = {} if run.cfg.deterministic else None
        self.router = StreamRouter(run.cluster, self.eta, run.rollouts, weights=lambda v: run.snapshots[v],
                                   digests=self.digests)
        self.window_calls: list[tuple[int, float, float]] = []

    def start(self) -> None:
        """Engines hold version 0 (`Cluster.start`); its digest for the pull checks."""
        run = self.run
        self.router.set_engines(run.assignment.devices(ROLLOUT), 0)
        if self.digests is not None:
            self.digests[0] = run.cluster.param_digest()

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
                router.release(s, run.job.requests(s))
        router.queue.forget_before(step)
        problems = router.queue.check_bounds(step)
        if problems:
            raise RuntimeError(f"streaming window {step}: " + "; ".join(problems))
        if w.scored is None:
            router.until_complete(step)
            self._spans()
            w.scored = run.job.score(step, run.rollouts[step].results, run.ledger)
        stop = threading.Event()
        more = any(s > step for s in router.queue.in_flight_steps())
        future = run.cluster.submit(router.pump, stop.is_set, f"rollout after {step}", stop.wait) if more else None
        try:
            if w.trained is None:
                w.trained = run._train(step, w.scored)
            run._finish_pending()
        finally:
            stop.set()
            if future is not None:
                future.result()
        self._spans()
        run.cluster.raise_if_lost(f"step {step}")
        if w.synced is None:
            if self.digests is not None:
                w.digest = self.digests[step + 1] = run.cluster.param_digest()
            w.synced = router.take_pulls()  # the engines' weight pulls of this window
        if not w.reported:
            report = run._report(w)
            w.reported = True
            run._decide(step, report)

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

    def before_resize(self, plan: ResizePlan) -> float | None:
        """Engines leaving the rollout pool finish their requests first; the drain's seconds."""
        moving = [d for d in plan.moving if d in plan.src.devices(ROLLOUT)]
        if not moving:
            return None
        t0, t1 = self.router.drain(moving)
        self._spans()
        return self.run.timing.clock.span(t0, t1)

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
