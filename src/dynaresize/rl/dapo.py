"""DAPO's two reward-side mechanisms, as verl runs them: soft overlong punishment and dynamic
sampling (group filtering). Pure: no torch, Ray or I/O.

Overlong shaping (`reward.overlong_buffer_len` L_b, `reward.overlong_penalty_factor` f, the
response budget L = `rollout.max_new_tokens`; verl's DAPO reward manager,
`reward_model.overlong_buffer`): a response of n tokens gets

    penalty(n) = min(-(n - (L - L_b)) / L_b * f, 0)

added to its reward: 0 up to L - L_b tokens, then linearly down to -f at L tokens.

Dynamic sampling (`algorithm.filter_groups`, verl's `filter_groups.enable/metric/max_num_gen_batches`
with `data.gen_batch_size` = `rollout.gen_prompts_per_step` G): a step generates batches of G
prompt groups; a group whose metric is the same for all its samples (all correct, all wrong)
carries no GRPO signal and is filtered out; batches go on until `rollout.prompts_per_step` P
groups are kept, and the step trains on the first P kept (by prompt index; later kept groups
are surplus, dropped as verl truncates its batch). With `max_num_gen_batches` M > 0, a step that
has generated M batches without P kept groups stops the run, as verl raises, naming the step.
With `algorithm.filter_metric = workload` (`WORKLOAD_METRIC`) the groups are filtered by the length
workload's model instead of a reward metric (workload.filtered_groups: batch b's prompt j at
step t is filtered with the workload's share at t): the job `dynaresize simulate --workload
dapo-filter` models, run for real, and the only filtering an emulated run paces (emulate/model.py).

Prompt indices (the `p` of sample id (step, p, s)): batch b's prompt j is p = b*G + j, so the
ids of a step never collide; batch 0 takes the step's prompts from the run's prompt stream (the
same as without filtering when G = P) and batch b >= 1 from a stream of its own, seeded by
(seed, b): which prompts a batch holds is a function of (seed, step, b) alone, never of device
counts or of how many batches earlier steps needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaresize.rl.data import prompt_order
from dynaresize.rl.seeds import derived_seed

FILTERED = "filtered"  # the ledger's drop reason starts with this
# `algorithm.filter_metric = workload`: the length workload's model decides which groups are
# filtered (workload.filtered_groups), not the rewards: the job the simulator's `dapo-filter`
# models, run for real (an emulated run of it is paced as the simulator predicts it).
WORKLOAD_METRIC = "workload"


def overlong_penalty(num_tokens: int, *, max_tokens: int, buffer_len: int, factor: float) -> float:
    """The soft overlong punishment of a response of `num_tokens` (see the module docstring); 0
    with `buffer_len` 0 (off)."""
    if buffer_len <= 0:
        return 0.0
    if buffer_len > max_tokens:
        raise ValueError(f"overlong buffer {buffer_len} exceeds the response budget {max_tokens}")
    exceed = num_tokens - (max_tokens - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def gen_batch_order(num_records: int, step: int, batch: int, num_prompts: int, seed: int) -> list[int]:
    """Indices into the prompt list of generation batch `batch` of `step` (G = `num_prompts`)."""
    if batch < 0:
        raise ValueError(f"bad generation batch {batch}")
    return prompt_order(num_records, step, num_prompts, seed if batch == 0 else derived_seed(seed, "gen-batch", batch))


def is_constant(values: list[float | None]) -> bool:
    """Whether a group's metric carries no signal: fewer than two values (left-out samples have
    None), or all equal (verl: std == 0)."""
    present = [v for v in values if v is not None]
    return len(present) < 2 or max(present) == min(present)


@dataclass
class GroupFilter:
    """The dynamic-sampling state of one step, fed one generation batch at a time.

    `add(groups)` takes each new group's metric values (by prompt index); `full` says P groups
    are kept, `capped` that the cap is reached without them. `chosen` are the groups the step
    trains on, `surplus` the kept ones beyond them, `filtered` the constant ones with why.
    """

    step: int
    target: int  # P: groups a step trains on
    max_batches: int  # M; 0: no cap
    batches: int = 0  # generation batches issued so far
    kept: list[int] = field(default_factory=list)
    filtered: dict[int, str] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)

    def add(self, groups: dict[int, list[float | None]], metric: str) -> None:
        for p in sorted(groups):
            if p in self.seen:
                raise ValueError(f"step {self.step}: prompt group {p} filtered twice")
            self.seen.add(p)
            values = groups[p]
            if is_constant(values):
                present = sorted({v for v in values if v is not None})
                self.filtered[p] = (f"{FILTERED}: group's {metric} is constant ({present[0]:g})" if present
                                    else f"{FILTERED}: group has no {metric}")
            else:
                self.kept.append(p)

    def add_decided(self, filtered: dict[int, bool], why: str) -> None:
        """Groups whose fate is decided elsewhere (by prompt index: True = filtered, for `why`):
        `algorithm.filter_metric = workload`."""
        for p in sorted(filtered):
            if p in self.seen:
                raise ValueError(f"step {self.step}: prompt group {p} filtered twice")
            self.seen.add(p)
            if filtered[p]:
                self.filtered[p] = f"{FILTERED}: {why}"
            else:
                self.kept.append(p)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    @property
    def capped(self) -> bool:
        return not self.full and self.max_batches > 0 and self.batches >= self.max_batches

    @property
    def chosen(self) -> list[int]:
        return sorted(self.kept)[:self.target]

    @property
    def surplus(self) -> list[int]:
        return sorted(self.kept)[self.target:]

    def cap_message(self) -> str:
        return (f"dynamic sampling of step {self.step}: {self.batches} generation batches (algorithm."
                f"max_num_gen_batches={self.max_batches}) kept {len(self.kept)} of the {self.target} prompt groups it needs "
                f"({len(self.filtered)} filtered: constant metric); check the data or the filter metric")
