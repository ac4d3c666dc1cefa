"""The sample ledger: proof that a resize changed no RL semantics.

Pure: no Ray, torch or I/O. The driver notes every sample when it is generated and when a
training step consumes it (or drops it, with a reason); `check()` then proves, for the run:

- every expected sample id `(step, prompt_index, sample_index)` was generated exactly once;
- each was consumed by exactly one training step, the step of its id, or recorded as dropped
  with a reason;
- `consumed_step - version <= staleness` for every consumed sample (the staleness bound);
- re-issued samples (after a fault) kept their id and seed.

Dynamic sampling (`algorithm.filter_groups`, rl/dapo.py): a step's expected ids grow with each
generation batch it issues; the samples of filtered (and surplus) groups are dropped with a
reason that starts with `filtered`.

Faults and stops (docs/faults.md): a sample sent again after its device was lost is noted
(`note_reissue`) and its entry says why (`reissued`); a run that stops early drops every
sample it generated but did not consume, with the reason, and waives the steps it will not
run (`stop_at`), so its verdict covers what it did. `state_before(step)` is the ledger as it
stood at a checkpoint boundary (what a resumed run continues from). Consumption is noted only
after the step's trainer state is safe (a snapshot), so a step redone after a loss never
counts a sample twice.

`sample_record()` gives the `sample` record (docs/records.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

SampleId = tuple[int, int, int]


def sample_id_str(sid: SampleId) -> str:
    return f"{sid[0]}-{sid[1]}-{sid[2]}"


@dataclass
class Entry:
    sample_id: SampleId
    version: int
    device: int
    num_tokens: int
    token_sha1: str
    seed: int
    reward: float | None = None
    reward_error: str | None = None
    consumed_step: int | None = None
    dropped: str | None = None
    times_generated: int = 1
    times_consumed: int = 0
    reissued: str | None = None  # why it was generated again (a lost device), if it was
    versions: tuple[tuple[int, int], ...] = ()  # partial rollout: (version, first token), when several made it
    turns: int = 0  # multi-turn: the trajectory's model turns (0: a single-turn sample)
    stop_reason: str = ""  # multi-turn: why it ended (done | max_turns | max_total_tokens | env_error)
    overlong_penalty: float | None = None  # reward.overlong_buffer_len: the shaping in `reward` (None: off)


@dataclass
class Ledger:
    staleness: int
    entries: dict[SampleId, Entry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    expected: dict[int, set[SampleId]] = field(default_factory=dict)
    waived: dict[int, str] = field(default_factory=dict)  # steps a stopped run will not run, and why
    reissues: dict[SampleId, str] = field(default_factory=dict)  # pending re-issues, and why

    def expect(self, step: int, ids: list[SampleId]) -> None:
        """Declare the sample ids a step must produce (from the prompt source, not the devices)."""
        self.expected[step] = set(ids)

    def generated(self, *, sample_id: SampleId, version: int, device: int, num_tokens: int,
                  token_sha1: str, seed: int, versions: tuple = (), turns: int = 0, stop_reason: str = "") -> Entry:
        old = self.entries.get(sample_id)
        if old is not None and old.dropped is None:
            old.times_generated += 1
            self.problems.append(f"sample {sample_id_str(sample_id)} generated twice")
            return old
        if old is not None and old.seed != seed:
            self.problems.append(f"sample {sample_id_str(sample_id)} re-issued with a different seed")
        entry = Entry(sample_id=sample_id, version=version, device=device, num_tokens=num_tokens,
                      token_sha1=token_sha1, seed=seed, reissued=self.reissues.pop(sample_id, None),
                      versions=tuple(tuple(v) for v in versions), turns=int(turns), stop_reason=stop_reason)
        self.entries[sample_id] = entry
        return entry

    def note_reissue(self, sample_id: SampleId, reason: str) -> None:
        """The sample is being generated again (same id and seed) because of `reason`."""
        self.reissues.setdefault(sample_id, reason)

    def scored(self, sample_id: SampleId, reward: float, error: str | None = None, *,
               overlong_penalty: float | None = None) -> None:
        entry = self.entries[sample_id]
        entry.reward, entry.reward_error, entry.overlong_penalty = reward, error, overlong_penalty

    def consumed(self, sample_id: SampleId, step: int) -> None:
        entry = self.entries.get(sample_id)
        if entry is None:
            self.problems.append(f"step {step} consumed unknown sample {sample_id_str(sample_id)}")
            return
        entry.times_consumed += 1
        if entry.consumed_step is not None:
            self.problems.append(f"sample {sample_id_str(sample_id)} consumed twice")
        entry.consumed_step = step

    def dropped(self, sample_id: SampleId, reason: str) -> None:
        entry = self.entries.get(sample_id)
        if entry is not None and entry.consumed_step is None:
            entry.dropped = reason

    def stop_at(self, step: int, reason: str) -> list[Entry]:
        """The run stops before consuming step `step`: drop every unconsumed sample of a step
        >= `step` with `reason`, and waive those steps. Returns the entries dropped now."""
        dropped = []
        for sid, e in self.entries.items():
            if sid[0] >= step and e.consumed_step is None and e.dropped is None:
                e.dropped = reason
                dropped.append(e)
        for s in [s for s in self.expected if s >= step]:
            self.waived[s] = reason
        return dropped

    def state_before(self, step: int) -> "Ledger":
        """A copy holding only steps before `step` (a checkpoint boundary)."""
        out = Ledger(staleness=self.staleness, problems=list(self.problems))
        out.entries = {sid: copy.copy(e) for sid, e in self.entries.items() if sid[0] < step}
        out.expected = {s: set(ids) for s, ids in self.expected.items() if s < step}
        out.waived = {s: r for s, r in self.waived.items() if s < step}
        return out

    def check(self) -> list[str]:
        """All violations found; an empty list means the ledger proves the run's semantics."""
        out = list(self.problems)
        for step, ids in sorted(self.expected.items()):
            if step in self.waived:
                continue
            missing = [sid for sid in ids if sid not in self.entries]
            if missing:
                out.append(f"step {step}: {len(missing)} expected samples never generated, e.g. "
                           f"{sample_id_str(sorted(missing)[0])}")
        for sid, e in self.entries.items():
            if e.consumed_step is None and e.dropped is None:
                out.append(f"sample {sample_id_str(sid)} neither consumed nor dropped")
            if e.consumed_step is not None:
                if e.consumed_step != sid[0]:
                    out.append(f"sample {sample_id_str(sid)} consumed by step {e.consumed_step}")
                if e.consumed_step - e.version > self.staleness:
                    out.append(f"sample {sample_id_str(sid)} version {e.version} too stale for "
                               f"step {e.consumed_step} (bound {self.staleness})")
                # under partial rollout a moved request may go on under an older version than its
                # prefix's newest (its step's), so versions need not ascend; none may be newer
                newest = max([e.version, *(v for v, _ in e.versions)])
                if newest > e.consumed_step or min([e.version, *(v for v, _ in e.versions)]) != e.version:
                    out.append(f"sample {sample_id_str(sid)}: token versions {list(e.versions)} newer than the "
                               f"step that consumed it ({e.consumed_step}) or older than its version {e.version}")
        return out

    def ok(self) -> bool:
        return not self.check()

    def step_sample_ids(self, step: int) -> set[SampleId]:
        return {sid for sid, e in self.entries.items() if sid[0] == step and e.consumed_step == step}


def sample_record(entry: Entry) -> dict:
    """The fields of one `sample` record (docs/records.md)."""
    return {
        "sample_id": sample_id_str(entry.sample_id),
        "version": entry.version,
        "device": entry.device,
        "num_tokens": entry.num_tokens,
        "token_sha1": entry.token_sha1,
        "reward": entry.reward,
        "consumed_step": entry.consumed_step,
        "dropped": entry.dropped,
        "seed": entry.seed,
        "reward_error": entry.reward_error,
        "reissued": entry.reissued,
        **({"versions": [list(v) for v in entry.versions]} if entry.versions else {}),
        **({"turns": entry.turns, "stop_reason": entry.stop_reason} if entry.turns else {}),
        **({"overlong_penalty": entry.overlong_penalty} if entry.overlong_penalty is not None else {}),
    }


def token_sha1(token_ids: list[int]) -> str:
    """sha1 of the response token ids written as decimal numbers joined by commas."""
    import hashlib

    return hashlib.sha1(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()
