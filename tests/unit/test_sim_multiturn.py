"""The multi-turn workload of the simulator and the emulator (`agent-tools`): trajectories of
1..max_turns turns with observations in their context and tool waits that hold their slot; the
stage model turns waits into rollout time (not training time), and `dynaresize simulate` reports
the workload's tail and the policies against best-static."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from dynaresize.costmodel.scenarios import workload_scenario
from dynaresize.workload import WORKLOADS, batch_for_step
from dynaresize.workload.lengths import multi_turn


def test_trajectories_have_turns_and_tool_waits_seeded_by_step():
    spec = WORKLOADS["agent-tools"]
    turns, wait = multi_turn(spec, 3, 4096, seed=0)
    assert turns.min() == 1 and turns.max() == spec.max_turns
    assert abs(turns.mean() - (1 - spec.turn_continue ** spec.max_turns) / (1 - spec.turn_continue)) < 0.15
    assert np.all(wait[turns == 1] == 0) and np.all(wait[turns > 1] > 0)
    assert np.median(wait[turns == 2]) < 2 * spec.tool_latency_s < wait.max()  # a heavy tail of tool calls
    again = multi_turn(spec, 3, 4096, seed=0)
    assert np.array_equal(again[0], turns) and np.array_equal(again[1], wait)
    assert not np.array_equal(multi_turn(spec, 4, 4096, seed=0)[1], wait)


def test_a_trajectorys_observations_and_waits_are_in_its_batch():
    b = batch_for_step("agent-tools", 2, 256, 0)
    spec = WORKLOADS["agent-tools"]
    turns, wait = multi_turn(spec, 2, 256, 0)
    plain = replace(spec, max_turns=1)
    assert b.wait_s is not None and np.array_equal(b.wait_s, wait)
    assert np.all(b.response_tokens >= (turns - 1) * spec.obs_tokens + 1)
    assert batch_for_step("longtail-drift", 2, 256, 0).wait_s is None and plain.max_turns == 1


def test_tool_waits_lengthen_rollout_not_training():
    sc = workload_scenario("agent-tools", num_devices=16, num_steps=4)
    stages = sc.stages()
    with_waits = sc.batch_of(1)
    no_waits = replace(with_waits, wait_s=None)
    from dynaresize.costmodel.stages import StageModel

    bare = StageModel(sc.model, lambda b: no_waits, sc.hardware)
    r1, r0 = stages.rollout(1, 8), bare.rollout(1, 8)
    assert r1.time_s > r0.time_s and r1.floor_s > r0.floor_s
    assert stages.train(1, 8).time_s == bare.train(1, 8).time_s
    assert stages.train_at_device_s(1, [0, 1, 2]) == bare.train_at_device_s(1, [0, 1, 2])


def test_simulate_reports_the_multi_turn_tail_and_hysteresis_against_best_static(tmp_path, capsys):
    from dynaresize.cli import main

    assert main(["simulate", "--workload", "agent-tools", "--devices", "32", "--steps", "40", "--quiet",
                 "--no-plots", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "workload agent-tools" in table and "best-static" in table and "hysteresis" in table
    doc = json.loads((tmp_path / "summary.json").read_text())
    by = {r["policy"]: r for r in doc["results"]}
    assert by["best-static"]["tail_idle_fraction"] > 0.05  # the tail of turns and tool waits
    assert by["hysteresis"]["samples_per_s"] >= 0.95 * by["best-static"]["samples_per_s"]
