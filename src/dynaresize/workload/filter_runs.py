"""A run's own filtered share (issue 33): the `dapo-filter` workload's share of filtered prompt
groups per step, from a dynaresize run directory that filtered (`algorithm.filter_groups`)
instead of the workload's modelled share.

A run's step record k says how many prompt groups step k scored and what became of them
(`groups_kept`, `groups_filtered`, `groups_surplus`, driver/dynamic_sampling.py); the share at
step k is groups_filtered / (groups_kept + groups_filtered + groups_surplus): the fraction of
the groups it generated whose metric was constant. Surplus groups had signal and count as kept.
The run directory is read as `dynaresize advise` reads one (its `records.jsonl`).

Reads files; otherwise pure (no clock, no Ray, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynaresize.errors import UserError
from dynaresize.records import run_records


@dataclass(frozen=True, kw_only=True)
class RunShares:
    """The filtered share per absolute step of a run (steps 0..len-1), and where it came from."""

    source: str
    shares: tuple[float, ...]
    groups: int  # prompt groups scored over the run

    def __post_init__(self) -> None:
        if not self.shares or not all(0.0 <= x <= 1.0 for x in self.shares):
            raise ValueError(f"{self.source}: shares must be in [0, 1], one per step, got {self.shares}")

    def describe(self) -> str:
        mean = sum(self.shares) / len(self.shares)
        return (f"the run {self.source}'s own groups_filtered: {len(self.shares)} steps, {self.groups} groups scored, "
                f"share {self.shares[0]:.2f} at step 0, {mean:.2f} on average, {self.shares[-1]:.2f} at its last step "
                "(held after it)")


def filter_shares(run_dir: str | Path) -> RunShares:
    """The filtered share per step of the run in `run_dir`; a UserError names what is missing."""
    p = Path(run_dir)
    path = p / "records.jsonl"
    by_step: dict[int, tuple[int, int]] = {}
    for rec in run_records(p, "step"):
        if "groups_filtered" in rec:
            filtered = int(rec["groups_filtered"])
            scored = int(rec["groups_kept"]) + filtered + int(rec.get("groups_surplus", 0))
            by_step[int(rec["step"])] = (filtered, scored)
    if not by_step:
        raise UserError(f"{path}: no step records with groups_filtered (a run with algorithm.filter_groups=true)")
    missing = sorted(set(range(max(by_step) + 1)) - set(by_step))
    if missing:
        raise UserError(f"{path}: no step record for step(s) {', '.join(map(str, missing[:10]))} (a run resumed "
                        "from elsewhere, or cut short)")
    shares = tuple(by_step[k][0] / by_step[k][1] for k in range(len(by_step)))
    return RunShares(source=str(p), shares=shares, groups=sum(s for _, s in by_step.values()))
