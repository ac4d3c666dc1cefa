"""What the driver keeps of a step while it runs, so a step interrupted by a device loss resumes
where it stood instead of starting over (docs/faults.md).

`StepRollout`: the rollout of one step, gathered over one or more attempts. Groups whose
results came back are kept; the groups left (their device was lost) are sent again with the
same sample ids and seeds. A step's samples are scored only once the rollout is complete.

`Window`: the phases of window k (score k, train k, weight sync k+1, report and resize) that are
done. A phase is marked done only when its effect is safe: `trained` only once the snapshot of
the new trainer state exists and the samples are noted as consumed; so after a recovery the
window redoes exactly the phases that are not done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRollout:
    step: int
    remaining: list[list[Any]]  # prompt groups (lists of GenRequest) not generated yet
    results: list[tuple[int, Any]] = field(default_factory=list)  # (device id, GenResult)
    calls: list[tuple[int, float, float]] = field(default_factory=list)
    requests: list[tuple[int, float, float]] = field(default_factory=list)  # (device, admitted, finished)
    busy_s: dict[int, float] = field(default_factory=dict)
    last_end: dict[int, float] = field(default_factory=dict)
    t0: float | None = None
    t1: float | None = None
    reissued: set = field(default_factory=set)

    @property
    def done(self) -> bool:
        return not self.remaining

    def absorb(self, outcome: Any) -> list[tuple[int, float, float]]:
        """Add one attempt's outcome (cluster.stages.RolloutOutcome); returns its engine calls."""
        self.results.extend(outcome.results)
        self.calls.extend(outcome.calls)
        self.requests.extend(outcome.requests)
        for d, s in outcome.busy_s.items():
            self.busy_s[d] = self.busy_s.get(d, 0.0) + s
        for d, t in outcome.last_end.items():
            self.last_end[d] = max(self.last_end.get(d, t), t)
        self.t0 = outcome.t0 if self.t0 is None else self.t0
        self.t1 = outcome.t1
        self.remaining = list(outcome.remaining)
        self.reissued.update(outcome.reissued)
        return list(outcome.calls)


@dataclass
class Window:
    step: int
    t0: float = field(default_factory=time.time)
    scored: Any = None  # job.ScoredStep
    trained: list[dict] | None = None  # per-device train stats
    synced: list[dict] | None = None  # per-device weight-sync stats
    digest: str | None = None
    reported: bool = False
    recoveries: int = 0

    def after_recovery(self) -> None:
        """Rollout weights were restored to an older version: the sync must run again."""
        self.synced = None
        self.digest = None
        self.recoveries += 1


def rollout_version(step: int, staleness: int) -> int:
    """The policy version whose weights generate the samples of `step` (one-step off-policy:
    version step-1; synchronous: version step; step 0 always version 0)."""
    return max(0, step - staleness)
