"""Values that cross the boundary between policy, controller, simulator and runtime.

Pure: no Ray, torch or I/O. Every value is frozen, so a report or a decision handed to the
controller cannot change under it, and the same value drives the simulator and the real
runtime.

Invariants:
- `Assignment.roles[d]` is the role of device `d`; devices are numbered 0..num_devices-1.
- `Bounds.allowed(r)` is the single place that says whether `r` rollout devices is legal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Role = Literal["rollout", "train"]
ROLLOUT: Role = "rollout"
TRAIN: Role = "train"
ROLES: tuple[Role, ...] = (ROLLOUT, TRAIN)


def other_role(role: Role) -> Role:
    return TRAIN if role == ROLLOUT else ROLLOUT


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Which role each device holds (device -> role)."""

    roles: tuple[Role, ...]

    @staticmethod
    def split(num_devices: int, num_rollout: int) -> "Assignment":
        """The canonical assignment: the first `num_rollout` devices roll out, the rest train."""
        return Assignment(roles=tuple([ROLLOUT] * num_rollout + [TRAIN] * (num_devices - num_rollout)))

    @property
    def num_devices(self) -> int:
        return len(self.roles)

    @property
    def num_rollout(self) -> int:
        return sum(1 for r in self.roles if r == ROLLOUT)

    @property
    def num_train(self) -> int:
        return self.num_devices - self.num_rollout

    def devices(self, role: Role) -> tuple[int, ...]:
        return tuple(d for d, r in enumerate(self.roles) if r == role)

    def count(self, role: Role) -> int:
        return self.num_rollout if role == ROLLOUT else self.num_train

    def moved(self, devices: tuple[int, ...], dst: Role) -> "Assignment":
        roles = list(self.roles)
        for d in devices:
            roles[d] = dst
        return Assignment(roles=tuple(roles))

    def to_json(self) -> dict:
        return {"rollout": list(self.devices(ROLLOUT)), "train": list(self.devices(TRAIN))}


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """Limits every policy obeys: minimum devices per role, the move unit, and optionally a
    fixed set of predefined splits.

    `move_unit` is the granularity of a move (for example the rollout tensor-parallel size):
    the rollout pool is always a multiple of it. `allowed_rollout`, when not empty, lists the
    only rollout-pool sizes a run may hold (the predefined Train:Rollout configurations of
    systems that switch among a few, e.g. (2, 4, 6) on 8 devices); every other bound still
    applies to them, so a listed size that breaks one is not legal either.
    """

    num_devices: int
    min_rollout: int = 1
    min_train: int = 1
    move_unit: int = 1
    allowed_rollout: tuple[int, ...] = ()

    def on_survivors(self, num_devices: int) -> "Bounds":
        """These bounds on `num_devices` survivors of a loss: the predefined splits that still fit
        (all of them gone: any legal split, so a run survives what it can)."""
        keep = tuple(r for r in self.allowed_rollout if r < num_devices)
        fit = Bounds(num_devices=num_devices, min_rollout=self.min_rollout, min_train=self.min_train,
                     move_unit=self.move_unit, allowed_rollout=keep)
        return fit if not keep or fit.splits() else Bounds(num_devices=num_devices, min_rollout=self.min_rollout,
                                                           min_train=self.min_train, move_unit=self.move_unit)

    def allowed(self, num_rollout: int) -> bool:
        return self.why_not(num_rollout) is None

    def splits(self) -> tuple[int, ...]:
        """Every legal rollout-pool size, ascending."""
        return tuple(r for r in range(0, self.num_devices + 1) if self.allowed(r))

    def why_not(self, num_rollout: int) -> str | None:
        """A one-line reason `num_rollout` is illegal, or None when it is legal."""
        if num_rollout < self.min_rollout:
            return f"rollout pool {num_rollout} < min_rollout {self.min_rollout}"
        if self.num_devices - num_rollout < self.min_train:
            return f"train pool {self.num_devices - num_rollout} < min_train {self.min_train}"
        if num_rollout % self.move_unit:
            return f"rollout pool {num_rollout} is not a multiple of move_unit {self.move_unit}"
        if self.allowed_rollout and num_rollout not in self.allowed_rollout:
            return (f"rollout pool {num_rollout} is not one of the predefined splits allowed_rollout="
                    f"{','.join(map(str, self.allowed_rollout))}")
        return None

    def nearest(self, num_rollout: float) -> int:
        """The legal split closest to `num_rollout` (ties go to the smaller pool)."""
        splits = self.splits()
        if not splits:
            raise ValueError(f"no legal split for {self}")
        return min(splits, key=lambda r: (abs(r - num_rollout), r))


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one finished step tells the controller. Measured (runtime) or modelled (sim).

    Times are seconds. `rollout_s` is the rollout stage of the step (first request to last
    response); `rollout_work_s` is the busy device-seconds of the rollout pool and
    `rollout_longest_s` the duration of the longest single request. Together they let a
    policy see whether rollout is throughput-bound (work / devices) or tail-bound (the longest
    request, which more devices do not shorten).
    """

    step: int
    now_s: float
    num_rollout: int
    num_train: int
    rollout_s: float
    train_s: float
    sync_s: float = 0.0
    step_s: float = 0.0
    rollout_work_s: float = 0.0
    rollout_longest_s: float = 0.0
    train_fixed_s: float = 0.0
    num_samples: int = 0
    response_tokens: int = 0
    idle_device_s: float = 0.0
    tail_idle_device_s: float = 0.0
    resize_critical_s: float | None = None  # measured cost of the move made before this step
    # The step's longest response decoded alone (its tokens x the engine's batch-1 per-token
    # latency): the part of the rollout stage that no number of rollout devices removes.
    rollout_floor_s: float = 0.0
    rollout_longest_tokens: int = 0  # response tokens of the step's longest response
    # Streaming pipeline (staleness >= 2), where the rollout of a step is cut into chunks that
    # free replicas take: how many chunks, the serial part of `rollout_work_s` (each chunk's decode steps x the engine's
    # batch-1 per-token latency: what a bigger chunk makes longer), and the device-seconds
    # replicas spent pulling weights for the step. 0 where not measured.
    rollout_chunks: int = 0
    rollout_slots: int = 0  # requests one replica admits at once (sequence cap or KV memory)
    rollout_serial_s: float = 0.0
    rollout_sync_s: float = 0.0
    # Seconds the trainers ran the step after its last sample arrived: all of `train_s` where a
    # step trains once its samples are in, the last groups and the optimizer step where they
    # accumulate gradients as groups arrive. 0 where not measured (read as `train_s`).
    train_tail_s: float = 0.0
    # The step's response lengths in tokens (any order); empty where not reported. The
    # throughput model of the streaming pipeline reads them to predict chunk times at other
    # pool sizes (the expected longest response of a chunk of m samples).
    response_lengths: tuple[int, ...] = ()
    # Training demand of the batches, in sequence tokens (prompt + response) summed over samples:
    # the batch trained in this step, and the batch the next step trains. In the one-step-off
    # pipeline the next step trains the batch this step rolled out, so its tokens are known
    # exactly before the decision. 0 where not reported.
    train_tokens: int = 0
    next_train_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Keep:
    """Leave the assignment as it is."""

    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Move:
    """Move `num_devices` devices from role `src` to role `dst`."""

    num_devices: int
    src: Role
    dst: Role
    reason: str = ""

    def target_rollout(self, current_rollout: int) -> int:
        return current_rollout + (self.num_devices if self.dst == ROLLOUT else -self.num_devices)


Decision = Union[Keep, Move]


def move_to(current_rollout: int, target_rollout: int, reason: str = "") -> Decision:
    """The decision that takes the rollout pool from `current_rollout` to `target_rollout`."""
    delta = target_rollout - current_rollout
    if delta == 0:
        return Keep(reason=reason)
    if delta > 0:
        return Move(num_devices=delta, src=TRAIN, dst=ROLLOUT, reason=reason)
    return Move(num_devices=-delta, src=ROLLOUT, dst=TRAIN, reason=reason)


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation of a resize plan, for one device."""

    name: str
    device: int
    critical: bool
    after: tuple[str, ...] = ()  # names of ops (same device) that must finish first


@dataclass(frozen=True, kw_only=True)
class ResizePlan:
    """How a resize is carried out: which devices move, and the ops, in order."""

    resize_id: int
    step: int
    src: Assignment
    dst: Assignment
    moving: tuple[int, ...]
    to_role: Role
    ops: tuple[Op, ...] = field(default=())
    reason: str = ""


# ------------------------------------------------------------------ string formats of config fields

FAULT_KINDS = ("kill", "stop", "node")  # node: the whole Ray node hosting DEVICE dies (docs/faults.md)
FAULT_POINTS = ("rollout", "train", "weight_sync", "resize.reshard", "resize.switch")


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """"2:3,4:1" -> ((2, 3), (4, 1)): before step 2 the rollout pool has 3 devices, ..."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step_s, sep, r_s = part.partition(":")
        if not sep or not step_s.strip().isdigit() or not r_s.strip().isdigit():
            raise ValueError(f"entry {part!r} is not STEP:R")
        out.append((int(step_s), int(r_s)))
    if [s for s, _ in out] != sorted({s for s, _ in out}):
        raise ValueError("steps must be strictly increasing")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    kind: str
    device: int
    point: str
    step: int


def parse_fault(text: str) -> FaultSpec:
    """"kill:1@train:3" -> FaultSpec(kind="kill", device=1, point="train", step=3)."""
    head, at, tail = text.partition("@")
    kind, _, dev = head.partition(":")
    point, _, step = tail.rpartition(":")
    if not at or kind not in FAULT_KINDS or not dev.isdigit() or point not in FAULT_POINTS or not step.isdigit():
        raise ValueError(f"expected KIND:DEVICE@POINT:STEP with KIND in {FAULT_KINDS} and POINT in {FAULT_POINTS}")
    return FaultSpec(kind=kind, device=int(dev), point=point, step=int(step))
