"""`dynaresize bench checkpoint`'s snapshot arithmetic: before/after per step and the extrapolation by bytes."""

from __future__ import annotations

import pytest

from dynaresize.commands.bench_checkpoint import SHAPES, snapshot_costs


def _rec(step, kind, nbytes, seconds, critical_s, cause="step"):
    return {"kind": "snapshot", "step": step, "snapshot_kind": kind, "bytes": nbytes, "seconds": seconds,
            "critical_s": critical_s, "cause": cause}


def test_before_after_and_extrapolation():
    records = [_rec(0, "full", 300, 0.2, 0.5, cause="start"), _rec(1, "params", 100, 0.1, 0.002),
               _rec(2, "full", 300, 0.3, 0.003), _rec(3, "params", 100, 0.1, 0.001)]
    summary = {"snapshot_every": 2, "snapshot_bytes_per_step": 500 / 3, "snapshots_full": 1, "snapshots_params": 2}
    out = snapshot_costs(records, summary, num_params=25)
    assert out["before"] == {"critical_s_per_step": 0.5, "copy_s": 0.2, "bytes_per_step": 300}
    a = out["after"]
    assert a["critical_s_per_step"] == pytest.approx(0.006 / 3)
    assert a["copy_s_per_step"] == pytest.approx(0.5 / 3)
    assert a["critical_over_seconds_max"] == pytest.approx(0.02)
    seven = out["extrapolated"]["7B"]
    scale = SHAPES["7B"] / 25
    assert seven["full_bytes"] == pytest.approx(300 * scale)  # 12 bytes per parameter: fp32 + two moments
    assert seven["before_critical_s_per_step"] == pytest.approx(0.5 * scale)
    assert seven["after_bytes_per_step"] == pytest.approx(500 / 3 * scale)
    assert out["every"] == 2 and out["steps"] == 3
