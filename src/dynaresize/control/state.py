"""Controller states and the commands a controller returns.

`Refusal` is the command that says a requested move was not made (bounds, cooldown, reversal
window) and why; the run goes on with the old assignment.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from dynaresize.types import ResizePlan


class ControllerState(str, enum.Enum):
    STEADY = "steady"  # may move on the next report
    RESIZING = "resizing"  # a plan is out; waiting for on_resize_done
    COOLDOWN = "cooldown"  # a move just finished; moves are suppressed for cooldown_steps reports


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A requested move that the controller did not carry out."""

    step: int
    requested_rollout: int
    reason: str


Command = Union[ResizePlan, Refusal]
