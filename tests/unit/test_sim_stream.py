"""The streaming pipeline (staleness >= 2): versions, the window, idle accounting, the two
overlaps (accumulate, admit), partial rollout, resizes (rollout -> train migrates), the exact
best-static sweep, and the shell's checks (migration itself: test_sim_migrate.py)."""

from dataclasses import replace

import numpy as np
import pytest

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.errors import ConfigError
from dynaresize.policy.baselines import Planned, Scripted
from dynaresize.records import Recorder
from dynaresize.sim.engine import run_policy
from dynaresize.sim.oracle import stream_best_static, stream_lower_bound
from dynaresize.sim.shell import simulate
from dynaresize.sim.stream import StreamEngine, rollout_version, run_stream

N, K = 16, 30


@pytest.fixture(scope="module")
def sc():
    return workload_scenario("longtail-drift", num_devices=N, num_steps=K, seed=1)


@pytest.fixture(scope="module")
def stages(sc):
    return sc.stages(batch_cache=K)


@pytest.fixture(scope="module")
def bounds(sc):
    return sc.bounds(PolicyConfig())


def _engine(sc, stages, bounds, policy, start, eta=2, partial=False, accumulate=True, admit=True):
    rec = Recorder(None)
    eng = StreamEngine(sc, stages, policy, bounds, start_rollout=start, staleness=eta, partial=partial,
                       accumulate=accumulate, admit=admit, reversal_window=4, recorder=rec)
    return eng, eng.run(), rec


def test_rollout_version():
    assert [rollout_version(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [rollout_version(k, 1) for k in range(3)] == [0, 0, 1]


@pytest.mark.parametrize("eta,accumulate", [(2, False), (2, True), (3, True)])
def test_versions_window_and_training_order(sc, stages, bounds, eta, accumulate):
    eng, res, rec = _engine(sc, stages, bounds, Planned("s", [12] * K), 12, eta=eta, accumulate=accumulate)
    steps = rec.of_kind("step")
    assert [s["step"] for s in steps] == list(range(K))
    fixed = stages.model.train_comm_s
    for s in steps:
        k = s["step"]
        assert s["version"] == max(0, k - eta) and s["version_max"] == s["version"]
        train_end = s["t_end_s"] - s["sync_s"]
        if accumulate:  # the optimizer step follows the step's last sample
            assert train_end >= s["rollout_done_s"] + fixed - 1e-9
        else:  # a step trains only when all its samples are in
            assert s["train_start_s"] >= s["rollout_done_s"] - 1e-9
            assert s["train_tail_s"] == pytest.approx(s["train_s"])
        # the compute is the same either way: the step's chunks add up to its training
        assert s["train_s"] == pytest.approx(stages.train(k, s["num_train"]).time_s, rel=1e-9)
        assert s["train_tail_s"] <= s["train_s"] + 1e-9
        if k - eta - 1 >= 0:  # released only once version k - eta is published
            assert s["released_s"] >= steps[k - eta - 1]["t_end_s"] - 1e-9
    # at most eta + 1 steps in rollout at once
    events = sorted([(s["released_s"], 1) for s in steps] + [(s["rollout_done_s"], -1) for s in steps],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak <= eta + 1
    # replicas do not wait for a step's last response: some step is released before the previous one is done
    assert any(steps[k]["released_s"] < steps[k - 1]["rollout_done_s"] for k in range(1, K))
    assert res.max_staleness == eta and res.mixed_version_samples == 0
    if accumulate:  # trainers start some step before its last sample is in
        assert any(s["train_start_s"] < s["rollout_done_s"] for s in steps)


@pytest.mark.parametrize("partial,accumulate,admit", [(False, False, False), (False, True, True), (True, True, True)])
def test_idle_accounting_adds_up(sc, stages, bounds, partial, accumulate, admit):
    eng, res, rec = _engine(sc, stages, bounds, Planned("s", [10] * K), 10, partial=partial, accumulate=accumulate,
                            admit=admit)
    total = N * res.total_time_s
    assert res.busy_device_s + res.idle_device_s == pytest.approx(total, rel=1e-9)
    assert res.idle_device_s == pytest.approx(res.bubble_idle_device_s + res.resize_idle_device_s)
    assert res.bubble_idle_device_s == pytest.approx(res.rollout_wait_idle_device_s + res.train_wait_idle_device_s)
    assert res.tail_idle_device_s == 0.0 and res.resize_idle_device_s == 0.0
    assert sum(s["idle_device_s"] for s in rec.of_kind("step")) == pytest.approx(res.idle_device_s, rel=1e-9)
    assert 0 < res.idle_device_s < total
    assert res.num_samples == sc.samples_per_step * K


def test_streaming_beats_its_own_one_step_off_pipeline_at_the_same_split(sc, stages, bounds):
    """Same split, same samples: the streaming run's replicas need not wait for each step's
    longest response, so it is faster than the one-step-off run."""
    lock = run_policy(sc, stages, Planned("s", [12] * K), bounds, start_rollout=12, reversal_window=4)
    stream = run_stream(sc, stages, Planned("s", [12] * K), bounds, start_rollout=12, staleness=2)
    assert stream.total_time_s < lock.total_time_s
    assert stream.num_samples == lock.num_samples


def test_each_overlap_saves_time_at_the_same_split(sc, stages, bounds):
    """accumulate: trainers wait less for a step's last share; admit: a replica's next share of
    the same version runs under its last requests. Same split, same samples, same versions."""
    plan = Planned("s", [12] * K)
    runs = {(acc, adm): _engine(sc, stages, bounds, plan, 12, accumulate=acc, admit=adm)[1]
            for acc, adm in [(False, False), (True, False), (False, True), (True, True)]}
    base = runs[(False, False)]
    assert runs[(True, False)].train_wait_idle_device_s < base.train_wait_idle_device_s
    assert runs[(True, False)].total_time_s < base.total_time_s
    assert runs[(False, True)].total_time_s < base.total_time_s
    assert runs[(True, True)].total_time_s < min(runs[(True, False)].total_time_s, runs[(False, True)].total_time_s)
    assert all(r.num_samples == base.num_samples and r.max_staleness == 2 and r.mixed_version_samples == 0
               for r in runs.values())


def test_partial_rollout_records_version_ranges_within_the_bound(sc, stages, bounds):
    _, full, _ = _engine(sc, stages, bounds, Planned("s", [12] * K), 12, partial=False)
    eng, part, rec = _engine(sc, stages, bounds, Planned("s", [12] * K), 12, partial=True)
    assert full.mixed_version_samples == 0 and full.max_version_span == 0
    assert part.mixed_version_samples > 0 and part.max_version_span >= 1
    assert part.max_staleness <= 2  # the oldest version of every sample is within the bound
    for s in rec.of_kind("step"):
        assert s["step"] - s["version"] <= 2 and s["version_max"] <= s["step"]
    assert part.partial and part.summary()["partial"] is True


def test_resizes_both_ways_migrate_and_keep_every_step(sc, stages, bounds):
    """train -> rollout after step 5, rollout -> train (migrated) after step 15."""
    pol = Scripted(((0, 10), (6, 12), (16, 8)))
    eng, res, rec = _engine(sc, stages, bounds, pol, 10)
    resizes = rec.of_kind("resize")
    assert [(len(r["from"]["rollout"]), len(r["to"]["rollout"])) for r in resizes] == [(10, 12), (12, 8)]
    assert resizes[0]["drain_s"] == 0.0 and resizes[1]["drain_s"] == 0.0  # nothing waits for a request
    assert "requests_moved" not in resizes[0] and resizes[1]["requests_moved"] == res.migrated_samples
    assert res.resizes == 2 and res.rollout_devices_final == 8
    steps = rec.of_kind("step")
    assert [s["step"] for s in steps] == list(range(K))
    n_train = [s["num_train"] for s in steps]
    assert n_train[0] == 6 and n_train[-1] == 8 and 4 in n_train  # 16 - 12 = 4 trainers in between
    assert res.resize_idle_device_s > 0
    assert res.idle_device_s == pytest.approx(res.bubble_idle_device_s + res.resize_idle_device_s)
    # which weights generate a step's samples does not depend on the moves
    assert all(s["version"] == max(0, s["step"] - 2) for s in steps)
    # the migrated devices' ops run from the decision: their critical path ends critical_s later
    to_train = [o for o in rec.of_kind("op") if o["resize_id"] == resizes[1]["resize_id"]]
    decided = steps[15]["t_end_s"]
    assert to_train and min(o["start_s"] for o in to_train) == pytest.approx(decided)
    assert max(o["end_s"] for o in to_train if o["critical"]) == pytest.approx(decided + resizes[1]["critical_s"])


def test_stream_engine_needs_staleness_2(sc, stages, bounds):
    with pytest.raises(ValueError, match="staleness"):
        StreamEngine(sc, stages, Planned("s", [8] * K), bounds, start_rollout=8, staleness=1)


@pytest.mark.parametrize("partial,admit", [(False, False), (False, True), (True, True)])
def test_best_static_sweep_is_exact(partial, admit):
    # (with tails overlapping the next share a bound from whole share times would exceed the true total)
    small = workload_scenario("longtail-stationary", num_devices=16, num_steps=20, seed=0)
    st = small.stages(batch_cache=20)
    b = small.bounds(PolicyConfig())
    best, total, simulated, bound = stream_best_static(small, st, b, b.splits(), 2, partial, admit=admit)
    everything = {r: run_stream(small, st, Planned("s", [r] * 20), b, start_rollout=r, staleness=2,
                                partial=partial, admit=admit).total_time_s for r in b.splits()}
    assert best == min(everything, key=lambda r: (everything[r], r))
    assert total == pytest.approx(everything[best])
    assert all(bound[r] <= everything[r] + 1e-6 for r in b.splits())  # a true lower bound
    assert set(simulated) <= set(b.splits())
    assert stream_lower_bound(st, 16, 20, best, partial or admit) <= total


def test_simulate_streaming_summary_and_refusals(sc):
    small = workload_scenario("longtail-drift", num_devices=12, num_steps=12, seed=0)
    doc = simulate(small, ["static-profiled", "best-static", "hysteresis"], staleness=2)
    assert doc["staleness"] == 2 and doc["partial"] is False and doc["accumulate"] and doc["admit"]
    res = {r["policy"]: r for r in doc["results"]}
    assert res["best-static"]["samples_per_s"] >= max(s["samples_per_s"] or 0 for s in doc["static_sweep"]) - 1e-9
    for r in doc["results"]:
        assert r["staleness"] == 2 and r["tail_idle_fraction"] == 0.0 and r["max_staleness"] <= 2
    with pytest.raises(ConfigError, match="one-step-off pipeline only"):
        simulate(small, ["oracle"], staleness=2)
    with pytest.raises(ConfigError, match="partial rollout needs staleness"):
        simulate(small, ["hysteresis"], staleness=1, partial=True)
    with pytest.raises(ConfigError, match="accumulate=False: streaming-pipeline switches"):
        simulate(small, ["hysteresis"], staleness=1, accumulate=False)
    with pytest.raises(ConfigError, match="admit=False with partial=True"):
        simulate(small, ["hysteresis"], staleness=2, partial=True, admit=False)
    with pytest.raises(ConfigError, match="staleness=0"):
        simulate(small, ["hysteresis"], staleness=0)


def test_streaming_simulation_is_deterministic():
    def once():
        s = workload_scenario("cap-raise", num_devices=12, num_steps=16, seed=3)
        doc = simulate(s, ["hysteresis", "greedy"], replace(PolicyConfig()), staleness=2, partial=True)
        return doc["results"]

    assert once() == once()


def test_chunk_table_matches_direct_computation(stages):
    for b, lo, hi in [(3, 0, 40), (3, 40, 80), (3, 500, 512), (7, 0, 1), (9, 128, 256)]:
        a, c = stages.chunk(b, lo, hi), stages._chunk(b, lo, hi)
        assert a.time_s == pytest.approx(c.time_s) and a.body_s == pytest.approx(c.body_s)
        assert a.serial_s == pytest.approx(c.serial_s) and a.longest_tokens == c.longest_tokens
        assert a.body_s <= a.time_s
    L = stages.batch(3).response_tokens[0:40]
    assert stages.chunk(3, 0, 40).longest_tokens == int(np.max(L))
