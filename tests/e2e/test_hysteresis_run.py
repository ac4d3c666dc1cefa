"""The product's policy on the real runtime: `hysteresis` decides every move of an emulated run
(the demo's job, compressed to 14 steps: six A100s x 7B emulated, the `demo-cap-raise` workload
whose cap rises 8x at the midpoint). Emulation paces each device by the cost model, so the stage
times the policy sees, and so its decisions, do not depend on this machine's speed (a stage whose
real work overran its paced time is flagged, and the test says so). The policy must give
training a device while the cap is low and take it back once it is raised: a policy that never
moves fails here."""

from __future__ import annotations

import json

import pytest

from dynaresize.records import read_records

pytestmark = pytest.mark.dist

STEPS = 14


def test_hysteresis_moves_a_device_each_way_on_the_runtime(tmp_path, capsys):
    from dynaresize.cli import main

    out = tmp_path / "run"
    rc = main(["run", "--preset", "demo", "--steps", str(STEPS), "--set", f"rollout.length_horizon_steps={STEPS}",
               "--set", "rollout.engine=hf", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    steps = list(read_records(out / "records.jsonl", "step"))
    overran = [s["step"] for s in steps if s.get("overrun")]
    assert not overran, f"steps {overran} overran their paced time: this machine was too slow for the time scale"

    decisions = list(read_records(out / "records.jsonl", "decision"))
    assert len(decisions) >= STEPS - 2 and all(d["reason"].strip() for d in decisions)
    moves = [d for d in decisions if d["action"] == "move"]
    resizes = list(read_records(out / "records.jsonl", "resize"))
    assert [r["to_role"] for r in resizes][:2] == ["train", "rollout"], [(r["step"], r["to_role"]) for r in resizes]
    assert len(moves) == len(resizes)
    # low cap first: training is the slower stage and gets a device; after the raise it goes back
    assert resizes[0]["step"] < STEPS // 2 <= resizes[1]["step"]
    assert summary["resizes_to_train"] >= 1 and summary["resizes_to_rollout"] >= 1
    # each move says what the policy's model predicted of the split it moved to
    for move, resize in zip(moves, resizes):
        target = len(resize["to"]["rollout"])
        assert move["step"] == resize["step"] and move["reason"].startswith("predicted "), move
        assert f"faster at {target} " in move["reason"], (move, target)
    # a keep says why: still learning the stage models, below the band, or not worth the cost
    assert {d["reason"].split()[0] for d in decisions if d["action"] == "keep"} >= {"learning", "gain"}
