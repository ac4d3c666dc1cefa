"""The product's policy: move only when a persistent, predicted gain beats the measured cost.

On every report the policy refits its online stage model (`policy.model`; `policy.stream_model` under streaming) and asks: at which
legal split would the step be fastest over the next `horizon_steps` steps (trends extrapolated
to mid-horizon)? Among splits within `NEAR_BEST` of the best it takes the one closest to the
current split (no move for a noise-level difference). Then:

- arm when the relative predicted gain is >= `enter_band`; stay armed while it is >= `exit_band`
  and points the same way; disarm otherwise (the band is the hysteresis). A gain
  between the two bands also arms when the window's reports agree on it: predicted once from
  each report's own parameters, its mean is more than `GAIN_T` standard errors above 0 (a
  small but persistent gain is worth taking when a move costs ~1 s against ~100 s steps),
  unless the move would reverse one made within `horizon_steps` (that takes the enter band);
- fire when armed for `dwell_steps` consecutive reports, no move was made in the last
  `cooldown_steps` reports, and the gain summed over the horizon (or the steps left, if fewer)
  exceeds `cost_margin` x the predicted cost of the move (doubled when the move reverses the
  previous one: it undoes a paid move);
- the move cost is the measured critical time of this run's resizes (`resize_critical_s` of the
  report after a move), an exponentially weighted mean; before the first move a pessimistic prior.

With `staleness=0` (the serial pipeline) the model adds the two stages instead of taking their
max, and there is no train-only last step.

In the one-step-off pipeline the next step trains the batch just rolled out: its training
demand is known (`StepReport.next_train_tokens`), so the next step's share of the summed gain,
and the last step's saving, are predicted from it rather than from the window mean.

Because the model knows the rollout floor (the longest response alone), it does not send
devices to a tail-bound rollout stage: the predicted gain of such a move is about zero.

Invariants (with the controller): never a move during cooldown; never an A -> B -> A reversal
within `reversal_window_steps` = dwell_steps + cooldown_steps; deterministic.
"""

from __future__ import annotations

import numpy as np

from dynaresize.config import PolicyConfig
from dynaresize.control.window import Persistence
from dynaresize.policy.model import OnlineStageModel
from dynaresize.policy.stream_model import StreamStageModel
from dynaresize.types import Bounds, Decision, Keep, StepReport, move_to

NEAR_BEST = 0.005  # splits predicted within 0.5% of the best count as equally good
GAIN_T = 2.0  # a gain in [exit_band, enter_band) arms when > this many standard errors
MIN_GAIN_SAMPLES = 3  # ... estimated from at least this many reports
COST_EWMA = 0.5


class Hysteresis:
    name = "hysteresis"

    def __init__(self, cfg: PolicyConfig, bounds: Bounds, *, num_steps: int | None = None,
                 start_rollout: int | None = None, window: int = 5, staleness: int = 1) -> None:
        self.cfg = cfg
        self.bounds = bounds
        self.num_steps = num_steps
        self.start_rollout = start_rollout
        self.cooldown_steps = cfg.cooldown_steps
        self.reversal_window_steps = cfg.dwell_steps + cfg.cooldown_steps
        self.staleness = int(staleness)
        self.stream = self.staleness >= 2
        self.serial = self.staleness == 0  # the serial pipeline: the stages' times add up
        if self.stream:
            self.model = StreamStageModel(move_unit=bounds.move_unit, window=window,
                                          trend_window=max(cfg.horizon_steps, 3), staleness=self.staleness)
        else:
            self.model = OnlineStageModel(window=window, trend_window=max(cfg.horizon_steps, 3), serial=self.serial)
        self.persist = Persistence()
        self.move_cost_s = cfg.move_cost_prior_s  # before any measured move (default pessimistic)
        self._cost_measured = False
        self._last_move: tuple[int, int] | None = None  # (step, direction)
        self.last_prediction: dict[str, float] = {}
        self._splits_cache: tuple[Bounds, np.ndarray] | None = None

    def on_bounds(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.persist.reset()

    def _learn_cost(self, report: StepReport) -> None:
        if report.resize_critical_s is None:
            return
        c = max(float(report.resize_critical_s), 0.0)
        self.move_cost_s = c if not self._cost_measured else (1 - COST_EWMA) * self.move_cost_s + COST_EWMA * c
        self._cost_measured = True

    def decide(self, report: StepReport) -> Decision:
        if self.stream:
            self.model.update(report, self._splits())
        else:
            self.model.update(report)
        self._learn_cost(report)
        cfg = self.cfg
        r = report.num_rollout
        n_dev = r + report.num_train
        left = cfg.horizon_steps if self.num_steps is None else self.num_steps - report.step - 1
        if left == 1 and not (self.stream or self.serial):
            return self._last_step(report)
        # one-step-off: the last step only trains (`_last_step`); a move whose cooldown would
        # still run then, or whose gain is summed over it, does not count on it (serial: every
        # step left rolls out and trains)
        horizon = min(cfg.horizon_steps, left if self.stream else left - cfg.cooldown_steps - (not self.serial))
        if horizon <= 0:
            return Keep(reason="no steps left to pay a move back")
        learning = self.model.num_reports < cfg.profile_steps
        if learning and self.stream:
            # streaming: steps 0..eta start together from version 0, so the first reports are the
            # pipeline's warm-up, not its steady state; they do not arm a move
            return Keep(reason=f"learning {self.model.num_reports}/{cfg.profile_steps}")
        ahead = horizon / 2.0
        splits = self._splits()
        preds = self.model.step_curve(splits, n_dev, ahead)
        current = self.model.step_s(r, n_dev, ahead)
        nxt = None if self.stream else self.model.step_curve_next(np.append(splits, r), n_dev)
        if nxt is not None:
            # one-step-off: the next step trains a batch already rolled out, so its step time is
            # predicted from its known demand; the other horizon - 1 steps from the window
            preds = (nxt[:-1] + (horizon - 1) * preds) / horizon
            current = (float(nxt[-1]) + (horizon - 1) * current) / horizon
        near = np.flatnonzero(preds <= preds.min() * (1 + NEAR_BEST))
        j = int(near[np.argmin(np.abs(splits[near] - r))])  # the nearest of the near-best splits
        target = int(splits[j])
        gain = current - float(preds[j])
        rel = gain / current if current > 0 else 0.0
        direction = (target > r) - (target < r)
        # A small but significant gain does not undo a recent move: that takes the enter band.
        recent = self._last_move is not None and direction == -self._last_move[1] \
            and report.step - self._last_move[0] < cfg.horizon_steps
        arm = rel >= cfg.enter_band or (rel >= cfg.exit_band and not recent
                                        and self._significant(r, target, n_dev, ahead))
        count = self.persist.update(direction, arm, rel >= cfg.exit_band)
        self.last_prediction = {"current_s": current, "target_s": float(preds[j]), "target": target, "gain": rel}
        if learning:  # one-step-off: the reports while profiling count toward the dwell; no move before profile_steps
            return Keep(reason=f"learning {self.model.num_reports}/{cfg.profile_steps}")
        if direction == 0 or count == 0:
            return Keep(reason=f"gain {rel:.3f} below band")
        if self._last_move is not None and report.step - self._last_move[0] <= cfg.cooldown_steps:
            return Keep(reason="cooldown")
        if count < cfg.dwell_steps:
            return Keep(reason=f"armed {count}/{cfg.dwell_steps} toward {target}")
        reverses = self._last_move is not None and direction == -self._last_move[1]
        if reverses and report.step - self._last_move[0] < self.reversal_window_steps:
            return Keep(reason="would reverse within the window")
        cost = self.move_cost_s * (2.0 if reverses else 1.0)
        if gain * horizon <= cfg.cost_margin * cost:
            return Keep(reason=f"gain {gain * horizon:.1f}s over {horizon} steps <= {cfg.cost_margin} x cost {cost:.1f}s")
        self.persist.reset()
        self._last_move = (report.step, direction)
        return move_to(r, target, reason=f"predicted {rel:.1%} faster at {target} ({current:.1f}s -> {preds[j]:.1f}s)")

    def _significant(self, r: int, target: int, n_dev: int, ahead: float) -> bool:
        """Is the predicted gain of `target` over `r` more than GAIN_T standard errors
        above 0, the gain predicted once from each report of the window (`gain_samples`)?"""
        g = self.model.gain_samples(r, target, n_dev, ahead)
        if g.size < MIN_GAIN_SAMPLES:
            return False
        return float(g.mean()) > GAIN_T * float(g.std(ddof=1)) / np.sqrt(g.size)

    def _last_step(self, report: StepReport) -> Decision:
        """Before the run's last step, which only trains (one-step-off: no batch is left to roll
        out): the step is fastest with the fewest rollout devices. Move there when the predicted
        saving beats `cost_margin` x the move cost, unless that reverses a recent move."""
        r = report.num_rollout
        n_dev = r + report.num_train
        target = int(self._splits()[0])
        if target >= r:
            return Keep(reason="last step: rollout pool already minimal")
        gain = self.model.train_s_next(n_dev - r) - self.model.train_s_next(n_dev - target)
        if self._last_move is not None and self._last_move[1] > 0 \
                and report.step - self._last_move[0] < self.reversal_window_steps:
            return Keep(reason="last step: would reverse within the window")
        if gain <= self.cfg.cost_margin * self.move_cost_s:
            return Keep(reason=f"last step: gain {gain:.1f}s <= {self.cfg.cost_margin} x cost {self.move_cost_s:.1f}s")
        self._last_move = (report.step, -1)
        return move_to(r, target, reason=f"last step trains only: {gain:.1f}s faster at {target}")

    def _splits(self) -> np.ndarray:
        if self._splits_cache is None or self._splits_cache[0] is not self.bounds:
            self._splits_cache = (self.bounds, np.asarray(self.bounds.splits(), dtype=np.int64))
        return self._splits_cache[1]
