"""The simulator: stage models, idle accounting, sweeps, oracle and engine agree, lending, costs."""

from dataclasses import replace

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.costs import get_model, min_train_devices, naive_resize_cost, rollout_constants
from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.costmodel.stages import Batch, StageModel
from dynaresize.policy.base import make_policy
from dynaresize.policy.baselines import Planned
from dynaresize.records import Recorder
from dynaresize.sim.engine import EventQueue, run_policy
from dynaresize.sim.oracle import best_static, build_table, grid, oracle_plan, pilot_split
from dynaresize.sim.resize import canonical_timing, lend_step
from dynaresize.types import Bounds

K = 24


@pytest.fixture(scope="module")
def setup():
    sc = workload_scenario("longtail-drift", num_devices=16, num_steps=K, seed=0)
    stages = sc.stages()
    bounds = sc.bounds(PolicyConfig())
    table = build_table(stages, bounds.splits(), 16, K)
    return sc, stages, bounds, table


def test_event_queue_orders_by_time_then_insertion():
    q = EventQueue()
    for t, kind in [(2.0, "b"), (1.0, "a"), (2.0, "c")]:
        q.push(t, kind)
    assert [q.pop()[1] for _ in range(3)] == ["a", "b", "c"]


def test_rollout_is_bounded_below_by_its_floor_and_tail_bound_at_scale():
    m = get_model("7b")
    lengths = np.array([16000] + [500] * 255)
    stages = StageModel(m, lambda b: Batch(lengths, np.full(lengths.shape, 512)))
    small, big = stages.rollout(0, 4), stages.rollout(0, 64)
    assert small.time_s >= small.floor_s and big.time_s >= big.floor_s
    assert big.time_s < small.time_s
    assert big.time_s / big.floor_s < 1.1  # with many replicas only the longest response remains
    assert big.tail_idle_device_s > 0.9 * 63 * (big.time_s - 500 * rollout_constants(m).t_weights * 1.5)
    assert small.work_device_s + small.tail_idle_device_s == pytest.approx(4 * small.time_s)


def test_kv_memory_limits_concurrency_into_waves():
    m = get_model("7b")
    c = rollout_constants(m)
    many = np.full(2000, 8000)
    st = StageModel(m, lambda b: Batch(many, np.full(many.shape, 512)))
    slots = st.data(0).slots
    assert slots < 2000 and slots == min(c.max_num_seqs, int(c.kv_capacity_tokens // (512 + 4000)))
    one_wave = st.rollout(0, 16).time_s
    two_waves = st.rollout(0, 4).time_s  # 500 requests per replica: more than its slots
    assert two_waves > 2 * one_wave


def test_training_scales_with_devices_and_tokens(setup):
    _, stages, _, _ = setup
    t8, t4 = stages.train(0, 8), stages.train(0, 4)
    assert (t4.time_s - t4.fixed_s) == pytest.approx(2 * (t8.time_s - t8.fixed_s))
    # lengths drift up over the workload's 300-step horizon (absolute steps: a K-step scenario
    # sees only its first K steps, so compare step 280 of a long one with step 0)
    long = workload_scenario("longtail-drift", num_devices=16, num_steps=300, seed=0).stages()
    assert long.train_device_s(280) > 1.5 * long.train_device_s(0)


def test_bounds_use_the_memory_floor_and_tp():
    assert min_train_devices(get_model("70b")) > min_train_devices(get_model("7b"))
    sc = workload_scenario("short-tail", num_devices=64, num_steps=2, model="70b")
    b = sc.bounds(PolicyConfig())
    assert b.move_unit == 4 and b.min_rollout == 4 and b.min_train == min_train_devices(get_model("70b"))


def test_idle_accounting_adds_up(setup):
    sc, stages, bounds, _ = setup
    pol = make_policy(replace(PolicyConfig(), name="greedy"), bounds, num_steps=K)
    rec = Recorder(None)
    res = run_policy(sc, stages, pol, bounds, start_rollout=8, reversal_window=20, recorder=rec)
    assert res.idle_device_s == pytest.approx(res.tail_idle_device_s + res.bubble_idle_device_s
                                              + res.resize_idle_device_s)
    assert 0 < res.idle_device_s < 16 * res.total_time_s
    steps = rec.of_kind("step")
    assert [s["step"] for s in steps] == list(range(K))
    assert all(b["t_start_s"] == pytest.approx(a["t_end_s"]) for a, b in zip(steps, steps[1:]))
    assert steps[-1]["t_end_s"] == pytest.approx(res.total_time_s)
    assert len(rec.of_kind("resize")) == res.resizes and len(rec.of_kind("decision")) == K - 1
    assert res.num_samples == sc.samples_per_step * K


def test_engine_pays_what_the_sweeps_predict(setup):
    sc, stages, bounds, table = setup
    r, predicted = best_static(table)
    res = run_policy(sc, stages, Planned("best-static", [r] * K), bounds, start_rollout=r, reversal_window=20)
    assert res.total_time_s == pytest.approx(predicted, rel=1e-9)
    path, oracle_total = oracle_plan(table, stages, 16)
    res_o = run_policy(sc, stages, Planned("oracle", path), bounds, start_rollout=path[0], reversal_window=20)
    assert res_o.total_time_s == pytest.approx(oracle_total, rel=1e-9)
    assert oracle_total <= predicted + 1e-9  # the oracle can always stay put
    assert predicted <= table.static_total().min() + 1e-9


def test_pilot_split_balances_the_first_steps(setup):
    _, stages, bounds, _ = setup
    p = pilot_split(stages, bounds, K, 3)

    def gap(r):
        return abs(np.mean([stages.rollout(k + 1, r).time_s - stages.train(k, 16 - r).time_s for k in range(3)]))

    assert all(gap(p) <= gap(r) + 1e-9 for r in bounds.splits())


def test_grid_limits_large_sweeps_and_keeps_the_pilot():
    b = Bounds(num_devices=1024, move_unit=1)
    g = grid(b, include=(517,))
    assert len(g) <= 65 and 517 in g and g[0] == b.splits()[0] and g[-1] == b.splits()[-1]


def test_resize_costs_optimized_vs_naive():
    m = get_model("32b")
    grow = canonical_timing(m, 64, 32, 34)
    shrink = canonical_timing(m, 64, 32, 30)
    naive = naive_resize_cost(m, 64)
    for t in (grow, shrink):
        assert 0 < t.critical_s < t.total_s < 10
    assert naive.critical_s > 10 * grow.critical_s


def test_lending_helps_only_when_trainers_are_idle_early():
    m = get_model("7b")
    times = np.array([100.0, 60.0, 60.0, 60.0])
    serial = np.array([50.0, 30.0, 30.0, 30.0])
    lent = lend_step(times, serial, train_s=20.0, num_train=4, model=m)
    assert lent.lent and lent.rollout_s < 100.0 and lent.back_s < 100.0
    t_avail = 20.0 + lent.switch_in_s
    assert lent.rollout_s >= t_avail + (100.0 - t_avail) * 0.5 - 1e-9  # the serial remainder stays
    late = lend_step(times, serial, train_s=99.0, num_train=4, model=m)
    assert not late.lent and late.rollout_s == 100.0


def test_lend_policy_never_slower_than_its_static_split(setup):
    sc, stages, bounds, _ = setup
    lend = make_policy(replace(PolicyConfig(), name="lend"), bounds, simulator=True, pilot_rollout=10)
    a = run_policy(sc, stages, lend, bounds, start_rollout=10, reversal_window=20)
    b = run_policy(sc, stages, Planned("static", [10] * K), bounds, start_rollout=10, reversal_window=20)
    assert a.total_time_s <= b.total_time_s + 1e-6
    assert a.resizes == 0


def test_simulation_is_deterministic():
    def once():
        sc = workload_scenario("cap-raise", num_devices=12, num_steps=10, seed=3)
        st = sc.stages()
        b = sc.bounds(PolicyConfig())
        pol = make_policy(replace(PolicyConfig(), name="hysteresis"), b, num_steps=10, pilot_rollout=6)
        return run_policy(sc, st, pol, b, start_rollout=6, reversal_window=20).summary()

    assert once() == once()


def test_reports_carry_the_trained_and_the_next_batchs_tokens(setup):
    """One-step-off: step k trains batch k and rolls out batch k+1, which step k+1 trains; the
    report of step k carries both batches' sequence tokens (0 for the next after the last)."""
    sc, stages, bounds, _ = setup
    seen = []

    class Spy(Planned):
        def decide(self, report):
            seen.append((report.step, report.train_tokens, report.next_train_tokens))
            return super().decide(report)

    run_policy(sc, stages, Spy("spy", [8] * K), bounds, start_rollout=8, reversal_window=20)

    def tokens(b):
        batch = stages.batch(b)
        return int(batch.response_tokens.sum() + batch.prompt_tokens.sum())

    assert [s for s, _, _ in seen] == list(range(K - 1))  # the last step's report is not decided on
    for k, t, nxt in seen:
        assert t == tokens(k) and nxt == tokens(k + 1)
    assert tokens(1) != tokens(2)
