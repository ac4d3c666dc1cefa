"""The controller's state machine, guards and device-loss rebuild, plus property tests over every
policy: bounds never broken, no move during cooldown, no A->B->A reversal within the window."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.config import PolicyConfig
from dynaresize.control.controller import Controller, ControllerState
from dynaresize.control.state import Refusal
from dynaresize.errors import ResizeRefused
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.types import ROLLOUT, TRAIN, Assignment, Bounds, Keep, Move, ResizePlan, StepReport


def report(step, r, n, roll=10.0, train=10.0, **kw):
    return StepReport(step=step, now_s=float(step), num_rollout=r, num_train=n, rollout_s=roll, train_s=train, **kw)


class Scripted:
    """A test policy returning given decisions in order."""

    name = "test"

    def __init__(self, decisions, cooldown=0, window=0):
        self.decisions = list(decisions)
        self.cooldown_steps = cooldown
        self.reversal_window_steps = window
        self.seen = []

    def decide(self, rep):
        self.seen.append(rep.step)
        return self.decisions.pop(0) if self.decisions else Keep()


def test_state_machine_steady_resizing_cooldown_steady():
    pol = Scripted([Move(num_devices=1, src=TRAIN, dst=ROLLOUT), Move(num_devices=1, src=TRAIN, dst=ROLLOUT),
                    Keep(), Move(num_devices=1, src=TRAIN, dst=ROLLOUT)], cooldown=2)
    ctl = Controller(policy=pol, bounds=Bounds(num_devices=8), assignment=Assignment.split(8, 3))
    assert ctl.state is ControllerState.STEADY
    [plan] = ctl.on_report(report(0, 3, 5))
    assert isinstance(plan, ResizePlan) and ctl.state is ControllerState.RESIZING
    assert ctl.assignment.num_rollout == 3  # applies only when done
    ctl.on_resize_done(plan.resize_id, 1.0, 2.0)
    assert ctl.assignment.num_rollout == 4 and ctl.state is ControllerState.COOLDOWN
    assert ctl.on_report(report(1, 4, 4)) == [] and ctl.last_note == "suppressed: cooldown"
    assert ctl.on_report(report(2, 4, 4)) == [] and ctl.state is ControllerState.STEADY
    [plan2] = ctl.on_report(report(3, 4, 4))
    assert plan2.resize_id == plan.resize_id + 1 and plan2.dst.num_rollout == 5
    assert pol.seen == [0, 1, 2, 3]  # the policy sees every report


def test_refuses_moves_the_bounds_forbid_and_goes_on():
    pol = Scripted([Move(num_devices=5, src=TRAIN, dst=ROLLOUT), Move(num_devices=1, src=TRAIN, dst=ROLLOUT)])
    ctl = Controller(policy=pol, bounds=Bounds(num_devices=8, min_train=2, move_unit=2), assignment=Assignment.split(8, 2))
    [refusal] = ctl.on_report(report(0, 2, 6))
    assert isinstance(refusal, Refusal) and refusal.requested_rollout == 7 and "train pool 1" in refusal.reason
    [refusal2] = ctl.on_report(report(1, 2, 6))
    assert "multiple of move_unit 2" in refusal2.reason
    assert ctl.state is ControllerState.STEADY and ctl.assignment.num_rollout == 2


def test_refuses_a_reversal_within_the_window():
    pol = Scripted([Move(num_devices=1, src=TRAIN, dst=ROLLOUT), Move(num_devices=1, src=ROLLOUT, dst=TRAIN),
                    Move(num_devices=1, src=ROLLOUT, dst=TRAIN)], window=3)
    ctl = Controller(policy=pol, bounds=Bounds(num_devices=8), assignment=Assignment.split(8, 3))
    [plan] = ctl.on_report(report(0, 3, 5))
    ctl.on_resize_done(plan.resize_id, 0.5, 1.0)
    [refusal] = ctl.on_report(report(1, 4, 4))
    assert isinstance(refusal, Refusal) and "reverses the move at step 0" in refusal.reason
    ctl.on_report(report(2, 4, 4))  # Keep
    pol.decisions = [Move(num_devices=1, src=ROLLOUT, dst=TRAIN)]
    [ok] = ctl.on_report(report(3, 4, 4))
    assert isinstance(ok, ResizePlan)


def test_resize_done_must_match_the_pending_plan():
    ctl = Controller(policy=Scripted([Move(num_devices=1, src=TRAIN, dst=ROLLOUT)]), bounds=Bounds(num_devices=4),
                     assignment=Assignment.split(4, 1))
    with pytest.raises(ValueError):
        ctl.on_resize_done(0, 1.0, 1.0)
    [plan] = ctl.on_report(report(0, 1, 3))
    with pytest.raises(ValueError):
        ctl.on_resize_done(plan.resize_id + 1, 1.0, 1.0)
    assert ctl.on_report(report(1, 1, 3)) == []  # still resizing: no second plan
    ctl.on_resize_failed(plan.resize_id)
    assert ctl.state is ControllerState.STEADY and ctl.assignment.num_rollout == 1


def test_initial_assignment_must_be_legal():
    with pytest.raises(ResizeRefused):
        Controller(policy=Scripted([]), bounds=Bounds(num_devices=4, min_train=2), assignment=Assignment.split(4, 3))


def test_devices_lost_rebuilds_within_bounds():
    ctl = Controller(policy=Scripted([]), bounds=Bounds(num_devices=8, min_rollout=2, min_train=2, move_unit=2),
                     assignment=Assignment.split(8, 4))
    a = ctl.on_devices_lost((0,))  # 7 survivors: 3 rollout (illegal: move unit 2) + 4 train
    assert a.num_devices == 7 and ctl.bounds.num_devices == 7
    assert ctl.bounds.allowed(a.num_rollout) and a.num_rollout in (2, 4)
    a2 = ctl.on_devices_lost((5, 6))
    assert a2.num_devices == 5 and ctl.bounds.allowed(a2.num_rollout)
    with pytest.raises(ResizeRefused):
        ctl.on_devices_lost((0, 1, 2))
    with pytest.raises(ValueError):
        ctl.on_devices_lost((99,))


# ------------------------------------------------------------------ property tests

POLICIES = ["hysteresis", "greedy", "static-profiled", "static:4", "lend", "scripted"]


def _run(policy, bounds, start, stage_times, cooldown_expected):
    ctl = Controller(policy=policy, bounds=bounds, assignment=Assignment.split(bounds.num_devices, start))
    moves = []  # (step, direction)
    last_done_step = None
    for step, (roll, train) in enumerate(stage_times):
        a = ctl.assignment
        assert bounds.allowed(a.num_rollout)
        rep = report(step, a.num_rollout, a.num_train, roll=roll * (8 / max(a.num_rollout, 1)) ** 0.5,
                     train=train * 8 / max(a.num_train, 1), rollout_floor_s=roll * 0.5, sync_s=0.5,
                     resize_critical_s=1.0 if last_done_step == step - 1 else None)
        for cmd in ctl.on_report(rep):
            if isinstance(cmd, ResizePlan):
                assert bounds.allowed(cmd.dst.num_rollout)
                if moves and cooldown_expected:
                    assert step - moves[-1][0] > cooldown_expected, "move during cooldown"
                direction = 1 if cmd.to_role == ROLLOUT else -1
                window = getattr(policy, "reversal_window_steps", 0)
                if moves and direction == -moves[-1][1]:
                    assert step - moves[-1][0] >= window, "reversal within the window"
                moves.append((step, direction))
                ctl.on_resize_done(cmd.resize_id, 1.0, 2.0)
                last_done_step = step
        assert bounds.allowed(ctl.assignment.num_rollout)
    return moves


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(POLICIES),
       n_dev=st.integers(min_value=4, max_value=24),
       unit=st.sampled_from([1, 2]),
       times=st.lists(st.tuples(st.floats(1.0, 100.0), st.floats(1.0, 100.0)), min_size=1, max_size=40),
       data=st.data())
def test_every_policy_respects_bounds_cooldown_and_reversal_window(name, n_dev, unit, times, data):
    bounds = Bounds(num_devices=n_dev, min_rollout=unit, min_train=2, move_unit=unit)
    splits = bounds.splits()
    start = data.draw(st.sampled_from(splits))
    cfg = replace(PolicyConfig(), name=name, enter_band=0.02, exit_band=0.01, schedule="3:5,6:2,9:99")
    policy = make_policy(cfg, bounds, num_steps=len(times), simulator=True)
    cooldown = cfg.cooldown_steps if name == "hysteresis" else 0
    _run(policy, bounds, start, times, cooldown)


@settings(max_examples=40, deadline=None)
@given(targets=st.lists(st.integers(0, 20), min_size=2, max_size=30), cooldown=st.integers(0, 3),
       window=st.integers(0, 5))
def test_adversarial_policy_cannot_break_the_guards(targets, cooldown, window):
    """A policy asking for arbitrary splits (legal or not) every step."""
    bounds = Bounds(num_devices=16, min_rollout=2, min_train=3, move_unit=2)
    policy = Planned("adversary", targets)
    policy.cooldown_steps = cooldown
    policy.reversal_window_steps = window
    _run(policy, bounds, 8, [(10.0, 10.0)] * len(targets), cooldown)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_dev=st.integers(min_value=6, max_value=24), unit=st.sampled_from([1, 2]),
       worlds=st.lists(st.tuples(st.floats(0.001, 0.05), st.floats(0.01, 2.0), st.floats(50.0, 3000.0)),
                       min_size=2, max_size=40),
       data=st.data())
def test_streaming_hysteresis_respects_bounds_cooldown_and_reversal_window(n_dev, unit, worlds, data):
    """Hysteresis with staleness 2 (the throughput model) fed random streaming reports: per step a
    per-token serial cost, a per-sample work and training device-seconds."""
    import numpy as np

    bounds = Bounds(num_devices=n_dev, min_rollout=unit, min_train=2, move_unit=unit)
    start = data.draw(st.sampled_from(bounds.splits()))
    cfg = replace(PolicyConfig(), name="hysteresis", enter_band=0.02, exit_band=0.01)
    policy = make_policy(cfg, bounds, num_steps=len(worlds), staleness=2)
    ctl = Controller(policy=policy, bounds=bounds, assignment=Assignment.split(n_dev, start))
    lengths = np.random.default_rng(len(worlds)).lognormal(6.5, 1.0, 256).astype(np.int64) + 1
    moves = []
    for step, (t_w, w, d) in enumerate(worlds):
        a = ctl.assignment
        reps = max(a.num_rollout // unit, 1)
        share = -(-lengths.size // reps)
        chunks = [lengths[i:i + share] for i in range(0, lengths.size, share)]
        serial = sum(float(c.max()) * t_w for c in chunks) * unit
        rep = report(step, a.num_rollout, a.num_train, roll=100.0, train=1.0 + d / max(a.num_train, 1),
                     sync_s=0.5, num_samples=int(lengths.size), rollout_work_s=serial + w * lengths.size * unit,
                     rollout_serial_s=serial, rollout_sync_s=float(len(chunks) * unit), rollout_chunks=len(chunks),
                     rollout_slots=256, response_lengths=tuple(int(x) for x in lengths), train_fixed_s=1.0,
                     resize_critical_s=1.0 if moves and moves[-1][0] == step - 1 else None)
        for cmd in ctl.on_report(rep):
            if isinstance(cmd, ResizePlan):
                assert bounds.allowed(cmd.dst.num_rollout)
                if moves:
                    assert step - moves[-1][0] > cfg.cooldown_steps, "move during cooldown"
                direction = 1 if cmd.to_role == ROLLOUT else -1
                if moves and direction == -moves[-1][1]:
                    assert step - moves[-1][0] >= policy.reversal_window_steps, "reversal within the window"
                moves.append((step, direction))
                ctl.on_resize_done(cmd.resize_id, 1.0, 2.0)
        assert bounds.allowed(ctl.assignment.num_rollout)


def test_predefined_splits_that_still_fit_survive_a_loss():
    from dynaresize.types import Bounds

    b = Bounds(num_devices=8, allowed_rollout=(2, 4, 6))
    assert b.on_survivors(6).allowed_rollout == (2, 4) and b.on_survivors(6).splits() == (2, 4)
    free = b.on_survivors(2)  # none of them fits two devices: any legal split, so the run survives
    assert free.allowed_rollout == () and free.splits() == (1,)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["hysteresis", "greedy"]),
       n_dev=st.integers(min_value=6, max_value=24),
       unit=st.sampled_from([1, 2]),
       heavy=st.floats(20.0, 100.0),
       toward=st.sampled_from([ROLLOUT, TRAIN]))
def test_a_clear_imbalance_makes_the_adaptive_policies_move_toward_the_slow_stage(name, n_dev, unit, heavy, toward):
    """The guards above pass for a policy that never moves; this one does not. One stage is 4-100x
    the other and stays so for 12 steps, from the split that starves it: the policy moves, first
    toward that stage."""
    bounds = Bounds(num_devices=n_dev, min_rollout=unit, min_train=2, move_unit=unit)
    splits = bounds.splits()
    start = splits[0] if toward == ROLLOUT else splits[-1]
    times = [(heavy, 1.0) if toward == ROLLOUT else (1.0, heavy)] * 12
    cfg = replace(PolicyConfig(), name=name, enter_band=0.02, exit_band=0.01)
    policy = make_policy(cfg, bounds, num_steps=len(times), simulator=True)
    moves = _run(policy, bounds, start, times, cfg.cooldown_steps if name == "hysteresis" else 0)
    assert moves, f"{name} never moved on a {heavy:.0f}x imbalance toward {toward}"
    assert moves[0][1] == (1 if toward == ROLLOUT else -1)
