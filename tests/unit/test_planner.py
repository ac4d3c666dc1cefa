"""Resize planning: which devices move and the op chain of each."""

import pytest

from dynaresize.control import planner
from dynaresize.control.planner import OP_NAMES, choose_moving, plan_resize
from dynaresize.costmodel.costs import get_model, op_cost
from dynaresize.types import ROLLOUT, TRAIN, Assignment


def test_grow_takes_lowest_train_devices_and_keeps_blocks_contiguous():
    src = Assignment.split(8, 3)
    plan = plan_resize(resize_id=1, step=4, src=src, target_rollout=5)
    assert plan.moving == (3, 4) and plan.to_role == ROLLOUT
    assert plan.dst == Assignment.split(8, 5)
    assert plan.step == 4 and plan.resize_id == 1


def test_shrink_takes_highest_rollout_devices():
    src = Assignment(roles=(TRAIN, ROLLOUT, ROLLOUT, TRAIN, ROLLOUT, TRAIN))
    plan = plan_resize(resize_id=0, step=0, src=src, target_rollout=1)
    assert plan.moving == (2, 4) and plan.to_role == TRAIN
    assert plan.dst.devices(ROLLOUT) == (1,)


def test_no_move_and_out_of_range():
    src = Assignment.split(4, 2)
    assert choose_moving(src, 2) == ()
    with pytest.raises(ValueError):
        choose_moving(src, 5)
    with pytest.raises(ValueError):
        choose_moving(src, -1)


@pytest.mark.parametrize("target,critical,background", [
    (4, planner.TO_ROLLOUT_CRITICAL, {n for n, _ in planner.TO_ROLLOUT_BACKGROUND}),
    (2, planner.TO_TRAIN_CRITICAL, {n for n, _ in planner.TO_TRAIN_BACKGROUND}),
])
def test_each_device_runs_one_critical_chain_then_background(target, critical, background):
    plan = plan_resize(resize_id=0, step=0, src=Assignment.split(6, 3), target_rollout=target)
    for d in plan.moving:
        ops = [op for op in plan.ops if op.device == d]
        crit = [op for op in ops if op.critical]
        assert tuple(op.name for op in crit) == critical
        assert all(op.after == (crit[i - 1].name,) for i, op in enumerate(crit) if i)
        assert {op.name for op in ops if not op.critical} == background
        names = {op.name for op in ops}
        assert all(set(op.after) <= names for op in ops)


def test_op_names_are_the_shared_contract_and_all_have_costs():
    assert OP_NAMES == {
        "drop_from_train_group", "move_param_shards", "load_weights", "alloc_kv_cache", "add_to_router",
        "move_optimizer_shards", "free_train_memory", "prewarm_groups", "stop_routing", "migrate_requests",
        "release_engine_memory", "join_train_group", "receive_param_shards", "receive_optimizer_shards"}
    m = get_model("7b")
    for name in OP_NAMES:
        seconds, nbytes = op_cost(name, m, num_train_before=8, num_train_after=7, num_moving=1)
        assert seconds > 0 and nbytes >= 0
    with pytest.raises(ValueError):
        op_cost("reboot", m, num_train_before=1, num_train_after=1, num_moving=1)


def test_every_planned_op_has_a_handler_and_a_cost_and_nothing_else():
    """The planner's op names, the runtime's op registry and the simulator's cost table are the
    same set, both directions; and every op of a plan each way is handled."""
    from dynaresize.cluster.resize_ops import HANDLERS, op_order
    from dynaresize.costmodel.costs import OP_COSTS

    assert set(HANDLERS) == set(planner.OP_NAMES) == set(OP_COSTS)
    src = Assignment.split(4, 2)
    for target in (1, 3):
        plan = planner.plan_resize(resize_id=0, step=0, src=src, target_rollout=target)
        names = op_order(plan)
        assert set(names) == {op.name for op in plan.ops} and len(names) == len(set(names))
        crit = [op.name for op in plan.ops if op.critical and op.device == plan.moving[0]]
        assert names[:len(crit)] == crit  # critical ops first, in chain order
