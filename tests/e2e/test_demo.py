"""`make demo` end to end (`dynaresize run --preset demo`), with the README's claims asserted: the
hysteresis policy gives training a device while the cap is low and takes it back once it is
raised (resizes each way), the ledger is whole, and the closing summary sets the run beside the
simulator's prediction for the static split it started from and for its own policy. Emulated
(six A100s x 7B), so the decisions do not depend on this machine's speed."""

from __future__ import annotations

import json

import pytest

from dynaresize.records import read_records

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~2 min: 20 paced steps on 6 workers


def _row(printed: str, name: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith(name))


def test_make_demo_moves_each_way_and_prints_its_prediction(tmp_path, capsys):
    from dynaresize.cli import main

    out = tmp_path / "demo"
    rc = main(["run", "--preset", "demo", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["emulate"] == "a100:7b" and summary["steps"] == 20 and summary["devices"] == 6
    resizes = list(read_records(out / "records.jsonl", "resize"))
    directions = [(r["step"], r["to_role"]) for r in resizes]
    assert resizes and resizes[0]["to_role"] == "train" and resizes[0]["step"] < 10, directions  # low cap
    assert any(r["to_role"] == "rollout" and r["step"] >= 10 for r in resizes), directions  # after the raise
    assert summary["resizes_to_train"] >= 1 and summary["resizes_to_rollout"] >= 1
    assert not [s["step"] for s in read_records(out / "records.jsonl", "step") if s.get("overrun")]
    # the headline: this run against the simulator's static split it started from, and its own prediction
    gain = _row(printed, "gain over static")
    assert "static split it started from (3 rollout)" in gain, gain
    ratio = float(_row(printed, "vs prediction").split()[2])
    assert 0.95 <= ratio <= 1.05, _row(printed, "vs prediction")  # paced by the same cost model
    assert _row(printed, "ledger").split()[1] == "ok"
    assert f"{summary['resizes_to_rollout']} to rollout, {summary['resizes_to_train']} to train" in _row(printed, "resizes")
