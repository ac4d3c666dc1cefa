"""Pure scheduling of the streaming pipeline (`train.staleness = eta >= 2`) on the real runtime.

No Ray, no torch: the driver's router (cluster/router.py) asks this queue what each free rollout
engine does next; the unit tests drive it with no workers at all.

Terms. Version v is the weights after v training steps; it exists once training step v-1 has
ended (version 0: the initial weights). The samples of step s are generated with version
`rollout_version(s, eta) = max(0, s - eta)`: a function of the step only, never of timing or
of which engine runs them, so a run with resizes generates the same samples as a static one.

Release rule. Once `trained` training steps have ended (versions 0..trained exist), the steps
s <= trained + eta are released (`released_through`): their groups join the queue in step
order. In the window of training step k (trained = k), the released steps are those up to
k + eta; step k itself is complete before training k starts (GRPO groups stay whole).

Dispatch rule (admission). An engine takes the next item (a share of consecutive samples,
pipeline/dispatch.stream_shares, at most the requests an engine holds) of the oldest step that
still has items queued: first in, first out. An engine holds one weight version at a time and
runs several items at once: while it runs some, it takes the next one if that item needs the
version it holds and either fits in its free slots (request-level admission: `free`, the
requests it may still hold) or finds every item it runs down to its last request (the tail,
`admitting`: a tail never blocks it). An item of another version waits until the engine's
items are done, then the engine pulls that version first (`Dispatch.pull`); under partial
rollout (`partial`) it pulls once in the tail and its tails go on under the newer weights. So, without
partial rollout, an engine never mixes versions, and which weights generate a sample depends
only on its step. A replica that finished its share of step s starts on s+1, s+2, ... as soon
as their versions exist instead of waiting for step s's longest response.

Moved items (a device left the rollout pool, or was lost, with requests in flight,
`put_back`): the unfinished requests go back to the front of the queue as an item of their step.

Bounds (checked by `check_bounds`, tested in tests/unit/test_streamplan.py), in the window of
training step k:
- steps in flight (released, not all generated): within {k, ..., k + eta}, so at most eta + 1
  (eta while step k trains: step k is complete by then);
- samples generated and not yet consumed: those of at most eta + 1 steps (k .. k + eta); only
  step k's are scored at a time (scoring happens just before its training);
- versions engines generate with: within [max(0, k - eta), k], one per engine at a time, so at
  most eta + 1 distinct ones (an idle engine may still hold an older one it does not use; none
  holds one newer than k + 1, the version a device joining after training k starts with);
  the driver keeps the weights of versions max(0, k - eta) .. k + 1 (at most eta + 2).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dynaresize.pipeline.stepstate import rollout_version


def released_through(trained: int, eta: int, num_steps: int) -> int:
    """The last step whose weights exist once `trained` training steps have ended."""
    return min(num_steps - 1, trained + eta)


@dataclass(frozen=True)
class Dispatch:
    """What one free engine does next: pull `version` first when `pull`, then generate `item`."""

    device: int
    step: int
    item: Any
    version: int
    pull: bool


@dataclass
class StreamQueue:
    """Released steps' items, the engines' versions, what each engine runs (see the module)."""

    eta: int
    queue: deque = field(default_factory=deque)  # (step, item), steps in ascending order
    outstanding: dict[int, int] = field(default_factory=dict)  # step -> items queued or in flight
    engine_version: dict[int, int] = field(default_factory=dict)  # rollout device -> version it holds
    busy: dict[int, list[int]] = field(default_factory=dict)  # device -> steps of its items in flight
    closed: set[int] = field(default_factory=set)  # devices that take no new item (draining)

    # ------------------------------------------------------------------ steps

    def release(self, step: int, items: list[Any]) -> None:
        """Add the items of `step` (released in step order; a step once)."""
        if step in self.outstanding:
            raise ValueError(f"step {step} released twice")
        if self.outstanding and step < max(self.outstanding):
            raise ValueError(f"step {step} released after step {max(self.outstanding)}")
        self.outstanding[step] = len(items)
        self.queue.extend((step, item) for item in items)

    def release_more(self, step: int, items: list[Any]) -> None:
        """More items of a released step (dynamic sampling's further generation batches): queued
        before every later step's items, so the queue stays in ascending step order."""
        if step not in self.outstanding:
            raise ValueError(f"step {step} is not released")
        self.outstanding[step] += len(items)
        at = next((i for i, (s, _) in enumerate(self.queue) if s > step), len(self.queue))
        for j, item in enumerate(items):
            self.queue.insert(at + j, (step, item))

    def released(self, step: int) -> bool:
        return step in self.outstanding

    def complete(self, step: int) -> bool:
        """Every item of `step` has been generated (its results are in)."""
        return self.outstanding.get(step) == 0

    def in_flight_steps(self) -> list[int]:
        """Released steps with items queued or running."""
        return sorted(s for s, n in self.outstanding.items() if n > 0)

    def forget_before(self, step: int) -> None:
        """Steps < `step` are consumed: drop their (complete) counts."""
        for s in [s for s in self.outstanding if s < step]:
            if self.outstanding[s]:
                raise ValueError(f"step {s} forgotten with {self.outstanding[s]} items outstanding")
            del self.outstanding[s]

    # ------------------------------------------------------------------ engines

    def add_engine(self, device: int, version: int) -> None:
        self.engine_version[device] = version
        self.closed.discard(device)

    def remove_engine(self, device: int) -> None:
        if self.busy.get(device):
            raise ValueError(f"engine {device} removed with steps {self.busy[device]} in flight")
        self.busy.pop(device, None)
        self.engine_version.pop(device, None)
        self.closed.discard(device)

    def close(self, devices) -> None:
        """Route nothing new to `devices` (a drain before they leave the rollout pool)."""
        self.closed.update(devices)

    def idle(self, devices) -> bool:
        return not any(self.busy.get(d) for d in devices)

    def head_step(self) -> int:
        """The step of the next item in line (-1 when nothing is queued)."""
        return self.queue[0][0] if self.queue else -1

    def next_for(self, device: int, *, admitting: bool = False, partial: bool = False,
                 free: int = 0) -> Dispatch | None:
        """The next item for an open engine (see the dispatch rule): None when it is closed or
        nothing is queued, or, while it runs items, when the next item neither fits in its
        `free` slots nor finds everything it runs in the tail (`admitting`), or would change
        its version (allowed only in the tail under `partial`)."""
        running = self.busy.get(device)
        if device in self.closed or device not in self.engine_version or not self.queue:
            return None
        step, item = self.queue[0]
        version = rollout_version(step, self.eta)
        pull = self.engine_version[device] != version
        if running and not ((admitting and partial) if pull else (admitting or len(item) <= free)):
            return None
        self.queue.popleft()
        self.engine_version[device] = version
        self.busy.setdefault(device, []).append(step)
        return Dispatch(device=device, step=step, item=item, version=version, pull=pull)

    def _leave(self, device: int, step: int) -> None:
        steps = self.busy.get(device) or []
        if step not in steps:
            raise ValueError(f"engine {device}: no item of step {step} in flight")
        steps.remove(step)

    def done(self, device: int, step: int) -> None:
        """The engine's item of `step` came back whole."""
        self._leave(device, step)
        self.outstanding[step] -= 1

    def put_back(self, device: int, step: int, item: Any) -> None:
        """The engine's item of `step` did not finish there (its device left or was lost):
        `item` (what it had not finished) is first in line again."""
        self._leave(device, step)
        self.queue.appendleft((step, item))

    # ------------------------------------------------------------------ bounds

    def versions_held(self) -> set[int]:
        return set(self.engine_version.values())

    def check_bounds(self, trained: int) -> list[str]:
        """Violations of the module's bounds in the window where `trained` steps have ended."""
        out = []
        lo, hi = trained, trained + self.eta
        flying = self.in_flight_steps()
        if any(s < lo or s > hi for s in flying) or len(flying) > self.eta + 1:
            out.append(f"steps in flight {flying} outside {lo}..{hi}")
        held = self.versions_held()
        vlo = rollout_version(trained, self.eta)
        busy_versions = {rollout_version(s, self.eta) for steps in self.busy.values() for s in steps}
        if any(v > trained for v in held) or any(v < vlo for v in busy_versions):
            out.append(f"engine versions {sorted(held)} (running {sorted(busy_versions)}) outside {vlo}..{trained}")
        return out
