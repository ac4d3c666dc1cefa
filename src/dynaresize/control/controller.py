"""The controller: one state machine that turns step reports into resize commands.

State diagram (one report per finished step; a returned plan applies before the next step):

                  on_report: policy says Move, guards pass -> [ResizePlan]
        +--------+ -----------------------------------------------> +----------+
        | STEADY |                                                  | RESIZING |
        +--------+ <------------ cooldown_steps == 0 -------------- +----------+
          ^   |  \\                                                      |
          |   |   `-- Move fails a guard -> [Refusal], stay STEADY      | on_resize_done
          |   `------ Keep -> [], stay STEADY                           v
          |                                                       +----------+
          +---------- after cooldown_steps reports -------------- | COOLDOWN |
                                                                  +----------+
        any state --on_devices_lost--> STEADY (assignment rebuilt on the survivors)

Guards, checked in this order for every Move: the target must be legal under `Bounds`
(min devices per role, move unit); the move must not reverse the previous move's direction
within the policy's `reversal_window_steps`. In RESIZING and COOLDOWN the policy still sees
every report (its model keeps learning) but its moves are suppressed (not refused: they are
the policy's own cooldown, not an error).

Invariants: the assignment the controller holds always satisfies the bounds; at most one
resize is out at a time; no move is made in COOLDOWN; no A -> B -> A reversal within the
reversal window. Deterministic: the same reports give the same commands.
"""

from __future__ import annotations

from dynaresize.control.planner import plan_resize
from dynaresize.control.state import Command, ControllerState, Refusal
from dynaresize.control.window import MoveHistory
from dynaresize.errors import ResizeRefused
from dynaresize.types import ROLLOUT, Assignment, Bounds, Decision, Keep, Move, ResizePlan, StepReport


class Controller:
    """Carries out a policy's decisions within bounds, one resize at a time."""

    def __init__(self, *, policy, bounds: Bounds, assignment: Assignment) -> None:
        if assignment.num_devices != bounds.num_devices:
            raise ValueError(f"assignment has {assignment.num_devices} devices, bounds {bounds.num_devices}")
        why = bounds.why_not(assignment.num_rollout)
        if why is not None:
            raise ResizeRefused(f"initial assignment breaks the bounds: {why}")
        self.policy = policy
        self.bounds = bounds
        self._assignment = assignment
        self._state = ControllerState.STEADY
        self._cooldown_left = 0
        self._next_resize_id = 0
        self._pending: ResizePlan | None = None
        self.history = MoveHistory()
        self.last_decision: Decision = Keep(reason="no report yet")
        self.last_note = ""  # why the last decision was suppressed, if it was

    @property
    def assignment(self) -> Assignment:
        return self._assignment

    @property
    def next_resize_id(self) -> int:
        """The id the next plan gets; a resumed run continues the count so ids stay unique."""
        return self._next_resize_id

    def continue_resize_ids(self, next_id: int) -> None:
        """Continue resize ids after a resume (ids already used must not be handed out again)."""
        self._next_resize_id = max(self._next_resize_id, int(next_id))

    @property
    def state(self) -> ControllerState:
        return self._state

    @property
    def cooldown_steps(self) -> int:
        return int(getattr(self.policy, "cooldown_steps", 0))

    @property
    def reversal_window_steps(self) -> int:
        return int(getattr(self.policy, "reversal_window_steps", 0))

    def on_report(self, report: StepReport) -> list[Command]:
        """Feed the report of a finished step; returns the commands to run before the next step."""
        decision = self.policy.decide(report)
        self.last_decision = decision
        self.last_note = ""
        if self._state is ControllerState.RESIZING:
            self.last_note = f"suppressed: resize {self._pending.resize_id} still running" if self._pending else ""
            return []
        if self._state is ControllerState.COOLDOWN:
            self._cooldown_left -= 1
            if self._cooldown_left <= 0:
                self._state = ControllerState.STEADY
            if isinstance(decision, Move):
                self.last_note = "suppressed: cooldown"
            return []
        if not isinstance(decision, Move):
            return []
        current = self._assignment.num_rollout
        target = decision.target_rollout(current)
        why = self.bounds.why_not(target) if 0 <= target <= self.bounds.num_devices else (
            f"rollout pool {target} outside 0..{self.bounds.num_devices}")
        direction = 1 if decision.dst == ROLLOUT else -1
        if why is None and target == current:
            return []
        if why is None and self.history.would_reverse(report.step, direction, self.reversal_window_steps):
            last_step = self.history.last()[0]
            why = f"reverses the move at step {last_step} within {self.reversal_window_steps} steps"
        if why is not None:
            return [Refusal(step=report.step, requested_rollout=target, reason=why)]
        plan = plan_resize(resize_id=self._next_resize_id, step=report.step, src=self._assignment,
                           target_rollout=target, reason=decision.reason)
        self._next_resize_id += 1
        self._pending = plan
        self._state = ControllerState.RESIZING
        self.history.record(report.step, direction)
        return [plan]

    def on_resize_done(self, resize_id: int, critical_s: float, total_s: float) -> None:
        """The runtime finished (at least the critical path of) the pending plan."""
        if self._state is not ControllerState.RESIZING or self._pending is None:
            raise ValueError(f"resize {resize_id} done but no resize is pending")
        if resize_id != self._pending.resize_id:
            raise ValueError(f"resize {resize_id} done but resize {self._pending.resize_id} is pending")
        self._assignment = self._pending.dst
        self._pending = None
        self.last_resize_s = (float(critical_s), float(total_s))
        self._cooldown_left = self.cooldown_steps
        self._state = ControllerState.COOLDOWN if self._cooldown_left > 0 else ControllerState.STEADY

    def on_resize_failed(self, resize_id: int) -> None:
        """The pending plan was rolled back: keep the old assignment and go back to STEADY."""
        if self._pending is None or resize_id != self._pending.resize_id:
            raise ValueError(f"resize {resize_id} failed but it is not pending")
        self._pending = None
        self._state = ControllerState.STEADY

    def on_devices_lost(self, devices: tuple[int, ...]) -> Assignment:
        """Rebuild the assignment on the surviving devices, renumbered 0..M-1 in their old order.

        The role of each survivor is kept where the bounds allow; otherwise the planner's rule
        moves the fewest devices to the nearest legal split. Raises ResizeRefused when no legal
        split exists on the survivors.
        """
        lost = set(devices)
        if not lost <= set(range(self._assignment.num_devices)):
            raise ValueError(f"unknown devices {sorted(lost - set(range(self._assignment.num_devices)))}")
        roles = tuple(r for d, r in enumerate(self._assignment.roles) if d not in lost)
        b = self.bounds
        bounds = b.on_survivors(len(roles))
        if not bounds.splits():
            raise ResizeRefused(f"no legal split on {len(roles)} surviving devices "
                                f"(min_rollout {b.min_rollout}, min_train {b.min_train}, move_unit {b.move_unit})")
        survivors = Assignment(roles=roles)
        target = survivors.num_rollout if bounds.allowed(survivors.num_rollout) else bounds.nearest(survivors.num_rollout)
        if target != survivors.num_rollout:
            survivors = plan_resize(resize_id=-1, step=-1, src=survivors, target_rollout=target).dst
        self.bounds = bounds
        self._assignment = survivors
        self._pending = None
        self._state = ControllerState.STEADY
        self._cooldown_left = 0
        if hasattr(self.policy, "on_bounds"):
            self.policy.on_bounds(bounds)
        return survivors


__all__ = ["Controller", "Command", "ControllerState", "Refusal"]


def decision_fields(ctl: Controller) -> dict:
    """The `action` and `reason` of the `decision` record for the controller's last report
    (`keep`, `move`, or `suppressed` when the controller held a move back)."""
    d = ctl.last_decision
    action = "suppressed" if ctl.last_note else ("move" if isinstance(d, Move) else "keep")
    return {"action": action, "reason": ctl.last_note or d.reason}
