"""`dynaresize compare` on a tiny emulated job: two policies on the runtime and in the simulator.

Checks the comparison's shape (one row per policy, measured beside predicted, the error's
definition, the plot, the runs' records), not how close the prediction is: that depends on this
machine's load and belongs to the benchmarks (docs/emulate.md has measured numbers).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.dist


@pytest.mark.slow  # ~39 s; emulated pacing against the model is in the default suite (tests/dist/test_emulate_run.py)
def test_compare_runs_each_policy_on_the_runtime_and_in_the_simulator(tmp_path, capsys):
    from dynaresize.cli import main

    out = tmp_path / "cmp"
    code = main(["compare", "--policies", "static:1,hysteresis", "--preset", "cpu", "--devices", "4",
                 "--rollout-devices", "1", "--steps", "3", "--emulate", "h200:7b", "--time-scale", "20",
                 "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4",
                 "--set", "rollout.max_new_tokens=4", "--set", "rollout.length_workload=short-tail",
                 "--set", "train.micro_batch_size=16", "--set", "rollout.engine=hf", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads((out / "summary.json").read_text())
    assert doc["emulate"] == "h200:7b" and doc["devices"] == 4 and doc["steps"] == 3 and doc["samples_per_step"] == 16
    assert [r["policy"] for r in doc["results"]] == ["static:1", "hysteresis"]
    for r in doc["results"]:
        for key in ("total_time_s", "samples_per_s", "idle_fraction", "resizes", "predicted_total_s",
                    "prediction_error", "overhead_s", "overrun_steps"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
        assert r["ledger_ok"]
        assert r["prediction_error"] == pytest.approx(r["predicted_total_s"] / r["total_time_s"] - 1)
        assert r["samples_per_s"] == pytest.approx(3 * 16 / r["total_time_s"])
        run = out / r["policy"].replace(":", "_")
        assert (run / "records.jsonl").is_file() and (run / "sim.jsonl").is_file()
        sim_steps = [json.loads(x) for x in (run / "sim.jsonl").read_text().splitlines()]
        assert sum(1 for x in sim_steps if x["kind"] == "step") == 3
    static = doc["results"][0]
    assert static["resizes"] == static["predicted_resizes"] == 0
    assert (out / "split.png").stat().st_size > 1000
    assert "error = predicted total time / measured - 1" in printed
    for r in doc["results"]:  # each policy's row carries its own error, as printed
        row = next(line for line in printed.splitlines() if line.startswith(r["policy"] + " "))
        assert f"{r['prediction_error']:+.1%}" in row, row


def test_compare_refuses_a_simulator_only_policy_before_running(tmp_path, capsys):
    from dynaresize.cli import main

    code = main(["compare", "--policies", "hysteresis,lend", "--emulate", "h100:7b", "--out", str(tmp_path / "x")])
    assert code == 2 and "simulator only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
