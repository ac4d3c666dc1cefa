"""Snapshots by interval, recovery by replay (driver/snapshots.py, docs/faults.md).

A run snapshots its trainers' full state only every K steps (a parameters-only copy between);
a loss restores the last full snapshot and replays the steps since from their kept scored
samples. Checked here: the records of a 10-step run with K = 3, and the longest replay (a
trainer killed K-1 steps after the last full snapshot) ending equal to the uninterrupted run.
How much of a snapshot sits on the step's path is a timing figure: `dynaresize bench checkpoint`
reports it (docs/faults.md), not these tests.
"""

from __future__ import annotations

import json

import pytest

from _runs import assert_same_run, job_config, ray_local, records, reference_run  # noqa: F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_full_snapshots_every_k_steps(ray_local, tmp_path):
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    summary = run_job(job_config(steps=10, checkpoint__snapshot_every_steps=3), out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    snaps = records(out, "snapshot")
    step_snaps = {r["step"]: r for r in snaps if r["cause"] == "step"}
    assert sorted(step_snaps) == list(range(1, 11))  # one per version, after each step
    full = sorted(v for v, r in step_snaps.items() if r["snapshot_kind"] == "full")
    assert full == [3, 6, 9, 10]  # every K = 3, and the last step (the final checkpoint reads it)
    assert [r["cause"] for r in snaps if r["step"] == 0] == ["start"]
    full_bytes = {r["bytes"] for r in step_snaps.values() if r["snapshot_kind"] == "full"}
    params_bytes = {r["bytes"] for r in step_snaps.values() if r["snapshot_kind"] == "params"}
    assert len(full_bytes) == len(params_bytes) == 1 and min(full_bytes) >= 3 * max(params_bytes)  # p + 2 moments
    assert all(0 <= r["critical_s"] and r["seconds"] > 0 for r in snaps)
    # each began in its step's own training call, its results collected off the main thread
    assert all(r["collector_s"] >= 0 for r in step_snaps.values())
    assert all(r["critical_s"] == pytest.approx(r["issue_s"] + r["wait_s"] + r["gate_s"]) for r in step_snaps.values())
    assert summary["snapshot_every"] == 3
    want = sum(r["bytes"] for r in step_snaps.values()) / 10
    assert summary["snapshot_bytes_per_step"] == pytest.approx(want)
    assert json.loads((out / "summary.json").read_text())["snapshot_every"] == 3


@pytest.mark.parametrize("staleness", [1, 2])
def test_fault_k_minus_1_steps_after_the_full_snapshot_replays_and_equals(ray_local, tmp_path, staleness):
    """K = 3: full snapshots at versions 0 and 3; trainer 3 killed training step 2 (2 = K-1 steps
    after version 0): the survivors restore version 0 and replay steps 0 and 1."""
    from dynaresize.driver.run import run_job

    out = tmp_path / "run"
    summary = run_job(job_config(checkpoint__snapshot_every_steps=3, faults=["kill:3@train:2"],
                                 train__staleness=staleness), out, progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["faults_injected"] == 1 and summary["faults_recovered"] == 1
    (rec,) = records(out, "recovery")
    assert rec["lost_devices"] == [3]
    assert (rec["restored_version"], rec["replayed_steps"], rec["trainer_version"]) == (0, [0, 1], 2)
    replays = [r for r in records(out, "span") if r["name"] == "train:replay"]
    assert sorted({r["step"] for r in replays}) == [0, 1]
    # after the replay the state is snapshotted in full: the new base of any later replay
    assert [r["snapshot_kind"] for r in records(out, "snapshot") if r["cause"] == "recovery" and r["step"] == 2] == \
        ["full"]
    assert_same_run(out, reference_run(staleness=staleness))
