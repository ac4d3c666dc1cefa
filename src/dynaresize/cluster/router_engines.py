"""What the streaming router (cluster/router.py) knows of each rollout engine: the items it
runs, the requests it holds, and how many more it may admit.

Admission (request level): an engine holds at most `slots` requests (`DriverPacing.engine_slots`:
`rollout.vllm_max_num_seqs`, or the emulated replica's), and takes the next item of the version
it holds as soon as the item fits in its free slots (`StreamEngine.free`); it also takes one when
everything it runs is down to its last request (`in_tail`, the simulator's `admit`: a tail never
blocks the engine). Items are at most `slots` long (pipeline.dispatch.stream_shares), so a free
engine always takes one whole. Engines are offered items in rounds, the emptiest first
(`admission_order`), one item each per round, so a step's shares spread over the engines
instead of filling the first one.

Pure bookkeeping: no Ray calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class StreamItem:
    """One dispatched item (a share of a step: consecutive samples, paced when emulated) on one engine."""

    step: int
    requests: Any  # list of GenRequest (PacedRequests when emulated)
    t0: float  # dispatched
    pending: dict = field(default_factory=dict)  # sample id -> request, not yet delivered
    due: dict = field(default_factory=dict)  # emulated: sample id -> when it may be delivered
    held: dict = field(default_factory=dict)  # emulated: sample id -> result come back before it is due
    real_end: float = 0.0

    @property
    def in_body(self) -> bool:
        """More than its last request still to come (the engine does not admit yet)."""
        return len(self.pending) > 1


@dataclass(eq=False)
class StreamEngine:
    """A replica's engine (keyed by its leader rank; its TP ranks get every call alike)."""

    ranks: tuple[int, ...] = ()
    items: list[StreamItem] = field(default_factory=list)
    to_add: list = field(default_factory=list)  # requests for its next `serve` call
    ref: Any = None  # its `serve` call in flight (a replicas.ReplicaCall)
    running: int = 0  # requests it said it still runs
    pulls: list = field(default_factory=list)  # weight pulls queued before its next serve
    busy_until: float = 0.0  # end of the last span recorded (spans are the union of its items)
    spans: list = field(default_factory=list)  # (admitted, delivered or None) of each request

    @property
    def holding(self) -> int:
        """Requests admitted and not yet delivered (emulated: also those done but not due)."""
        return sum(len(it.pending) for it in self.items)

    def free(self, slots: int) -> int:
        """Slots it may still fill."""
        return max(0, int(slots) - self.holding)

    @property
    def in_tail(self) -> bool:
        """Everything it runs is down to its last request (or it runs nothing)."""
        return not any(it.in_body for it in self.items)


def admission_order(engines: dict[int, StreamEngine]) -> list[int]:
    """The engines (leader ranks) in the order one admission round offers them items: the one
    holding the fewest requests first, ties by rank."""
    return sorted(engines, key=lambda d: (engines[d].holding, d))

