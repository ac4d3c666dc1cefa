"""Baseline policies, implemented faithfully for an honest comparison (docs/policies.md).

- `Static(R)`: a fixed split (moves once to R if the run starts elsewhere).
- `StaticProfiled`: the split that balances the two stages on the first `profile_steps` steps,
  then fixed: what a user tunes in a pilot run. Given a pilot result (the simulator sweeps the
  first steps at every split) it starts there; otherwise it fits the online stage model on its
  first reports and moves once to the balanced split.
- `Greedy`: the imbalance-ratio rule of existing dynamic schedulers. Whenever the slower stage
  takes more than `greedy_threshold` times the faster one, rebalance in proportion to each
  stage's device-seconds (which assumes both stages scale linearly with devices); no dwell, no
  cooldown, no cost model.
- `Scripted`: a schedule "STEP:R,..." (before step STEP the rollout pool has R devices).
- `Lend`: trainers lend themselves to rollout inside each step and return before the next
  training stage; the step-boundary split never changes (simulator only: the lending happens
  inside a step, see `sim.engine`).
- `Planned`: a precomputed target per step (the simulator's `best-static` and `oracle`).
"""

from __future__ import annotations

from dynaresize.config import PolicyConfig
from dynaresize.policy.model import OnlineStageModel
from dynaresize.types import Bounds, Decision, Keep, StepReport, move_to


class Static:
    def __init__(self, target: int | None, *, name: str = "static") -> None:
        self.name = name
        self.target = target
        self.start_rollout = target
        self._asked = False

    def decide(self, report: StepReport) -> Decision:
        if self.target is None or self._asked or report.num_rollout == self.target:
            return Keep(reason="static")
        self._asked = True  # ask once; a refused target is not asked again
        return move_to(report.num_rollout, self.target, reason=f"static split {self.target}")


class StaticProfiled:
    name = "static-profiled"

    def __init__(self, cfg: PolicyConfig, bounds: Bounds, *, pilot_rollout: int | None = None) -> None:
        self.bounds = bounds
        self.profile_steps = cfg.profile_steps
        self.start_rollout = pilot_rollout
        self.model = OnlineStageModel(window=max(cfg.profile_steps, 1))
        self._done = pilot_rollout is not None

    def on_bounds(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def decide(self, report: StepReport) -> Decision:
        if self._done:
            return Keep(reason="profiled split fixed")
        self.model.update(report)
        if self.model.num_reports < self.profile_steps:
            return Keep(reason=f"profiling {self.model.num_reports}/{self.profile_steps}")
        self._done = True
        target = self.model.balanced_split(self.bounds.splits(), report.num_rollout + report.num_train)
        return move_to(report.num_rollout, target, reason=f"pilot: stages balance at {target}")


class Greedy:
    name = "greedy"

    def __init__(self, cfg: PolicyConfig, bounds: Bounds, *, start_rollout: int | None = None) -> None:
        self.bounds = bounds
        self.threshold = cfg.greedy_threshold
        self.start_rollout = start_rollout

    def on_bounds(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def decide(self, report: StepReport) -> Decision:
        r, n = report.num_rollout, report.num_train
        t_roll, t_train = report.rollout_s, report.train_s
        if min(t_roll, t_train) <= 0:
            return Keep(reason="no stage times")
        ratio = max(t_roll, t_train) / min(t_roll, t_train)
        if ratio <= self.threshold:
            return Keep(reason=f"ratio {ratio:.2f} <= {self.threshold}")
        # Each stage's device-seconds stay fixed if it scales linearly: split them evenly in time.
        roll_dev_s, train_dev_s = t_roll * r, t_train * n
        ideal = (r + n) * roll_dev_s / (roll_dev_s + train_dev_s)
        target = self.bounds.nearest(ideal)
        if target == r:  # the rounding kept us here: move one unit toward the slower stage
            step = self.bounds.move_unit if t_roll > t_train else -self.bounds.move_unit
            if self.bounds.allowed(r + step):
                target = r + step
        return move_to(r, target, reason=f"ratio {ratio:.2f} > {self.threshold}")


class Scripted:
    name = "scripted"

    def __init__(self, schedule: tuple[tuple[int, int], ...]) -> None:
        self.schedule = dict(schedule)
        self.start_rollout = self.schedule.get(0)

    def decide(self, report: StepReport) -> Decision:
        target = self.schedule.get(report.step + 1)
        if target is None:
            return Keep(reason="scripted")
        return move_to(report.num_rollout, target, reason=f"scripted: before step {report.step + 1} -> {target}")


class Lend:
    name = "lend"
    lends = True

    def __init__(self, *, start_rollout: int | None = None) -> None:
        self.start_rollout = start_rollout

    def decide(self, report: StepReport) -> Decision:
        return Keep(reason="lend: the step-boundary split is fixed")


class Planned:
    """Moves to a precomputed target before each step (`targets[k]` = rollout devices in step k)."""

    def __init__(self, name: str, targets: list[int]) -> None:
        self.name = name
        self.targets = list(targets)
        self.start_rollout = self.targets[0] if self.targets else None

    def decide(self, report: StepReport) -> Decision:
        k = report.step + 1
        if k >= len(self.targets):
            return Keep(reason="plan done")
        return move_to(report.num_rollout, self.targets[k], reason=f"{self.name} plan")
