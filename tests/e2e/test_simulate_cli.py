"""`dynaresize simulate` and `dynaresize bench sim` end to end (in process, small sizes)."""

import json

import pytest

from dynaresize.cli import main
from dynaresize.records import SCHEMA, read_records

RESULT_KEYS = {"policy", "total_time_s", "samples_per_s", "idle_fraction", "tail_idle_fraction", "resizes",
               "reversals", "rollout_devices_final"}


def test_simulate_writes_summary_records_and_plots(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "longtail-drift", "--devices", "16", "--steps", "20", "--seed", "1",
               "--out", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads((out / "summary.json").read_text())
    assert doc["workload"] == "longtail-drift" and doc["devices"] == 16 and doc["steps"] == 20
    names = [r["policy"] for r in doc["results"]]
    assert names == ["static-profiled", "best-static", "hysteresis", "greedy", "lend", "oracle"]
    for r in doc["results"]:
        assert RESULT_KEYS <= set(r)
        assert 0 <= r["tail_idle_fraction"] <= r["idle_fraction"] < 1
    best = next(r for r in doc["results"] if r["policy"] == "best-static")
    assert isinstance(best["rollout_devices"], int)
    by = {r["policy"]: r["samples_per_s"] for r in doc["results"]}
    assert by["oracle"] >= by["best-static"] * (1 - 1e-9)
    assert {"train_to_rollout", "rollout_to_train", "naive"} <= set(doc["resize_cost_model"])
    for name in names:
        recs = list(read_records(out / name / "records.jsonl"))
        kinds = {r["kind"] for r in recs}
        assert {"config", "step", "decision", "summary"} <= kinds or name == "static-profiled"
        assert recs[0]["kind"] == "config" and recs[-1]["kind"] == "summary"
        for r in recs:
            assert set(SCHEMA[r["kind"]]) <= set(r)
        assert sum(r["kind"] == "step" for r in recs) == 20
    hys = list(read_records(out / "hysteresis" / "records.jsonl", "resize"))
    assert len(hys) == next(r["resizes"] for r in doc["results"] if r["policy"] == "hysteresis")
    assert (out / "allocation.png").stat().st_size > 1000 and (out / "throughput.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "hysteresis" in table and "samples/s" in table and "naive" in table


def test_simulate_a_trace_and_static_policies(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"step": k, "response_tokens": [100 + 37 * ((k * 7 + i) % 11) * (1 + (i == 0) * 20)
                                                        for i in range(64)]}) for k in range(12)]
    trace.write_text("\n".join(lines) + "\n")
    rc = main(["simulate", "--trace", str(trace), "--devices", "8", "--policies", "static:4,hysteresis,scripted",
               "--set", "policy.schedule=3:2,6:5", "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])
    assert rc == 0
    doc = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert doc["steps"] == 12 and doc["samples_per_step"] == 64
    res = {r["policy"]: r for r in doc["results"]}
    assert res["static:4"]["rollout_devices_final"] == 4 and res["static:4"]["resizes"] == 0
    assert res["scripted"]["resizes"] == 2 and res["scripted"]["rollout_devices_final"] == 5
    assert not (tmp_path / "o" / "allocation.png").exists()


@pytest.mark.parametrize("content,needle", [
    ('{"step": 0, "response_tokens": [1]}\n{"step": 1, "response_tokens": [-4]}\n', ":2: response_tokens[0] = -4"),
    ('{"step": 0, "response_tokens": [1]}\n{oops\n', ":2: bad JSON"),
    ('{"step": 0, "response_tokens": []}\n', ":1: response_tokens is empty"),
    ('{"step": 0}\n', ":1: missing response_tokens"),
])
def test_malformed_trace_exits_2_with_one_line(tmp_path, capsys, content, needle):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(content)
    rc = main(["simulate", "--trace", str(trace), "--devices", "8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and str(trace) in err and len(err.splitlines()) == 1


def test_bad_flags_exit_2(tmp_path, capsys):
    assert main(["simulate", "--workload", "longtail-drift", "--policies", "hysteresis,nope",
                 "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["simulate", "--workload", "short-tail", "--devices", "1", "--out", str(tmp_path)]) == 2
    capsys.readouterr()
    assert main(["simulate", "--workload", "short-tail", "--set", "policy.enter_band=-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "enter_band=-1" in err and "must be >= 0" in err and len(err.splitlines()) == 1, err


def test_bench_sim_small(tmp_path, capsys):
    rc = main(["bench", "sim", "--devices", "32", "--steps", "20", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench_sim.json").read_text())
    assert result["devices"] == 32 and result["steps"] == 20 and result["wall_s"] > 0
    assert "wall" in capsys.readouterr().out


def test_simulate_streaming_pipeline(tmp_path, capsys):
    out = tmp_path / "s2"
    rc = main(["simulate", "--workload", "cap-raise", "--devices", "12", "--steps", "16", "--staleness", "2",
               "--partial", "--out", str(out), "--quiet", "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "summary.json").read_text())
    assert doc["staleness"] == 2 and doc["partial"] is True
    assert [r["policy"] for r in doc["results"]] == ["static-profiled", "best-static", "hysteresis", "greedy"]
    best = next(r for r in doc["results"] if r["policy"] == "best-static")
    swept = [s for s in doc["static_sweep"] if s["total_time_s"] is not None]
    assert best["rollout_devices"] == min(swept, key=lambda s: s["total_time_s"])["rollout_devices"]
    for r in doc["results"]:
        assert r["staleness"] == 2 and r["max_staleness"] <= 2 and r["tail_idle_fraction"] == 0.0
        assert 0 <= r["idle_fraction"] < 1
    steps = list(read_records(out / "hysteresis" / "records.jsonl", "step"))
    assert len(steps) == 16 and all(s["step"] - s["version"] <= 2 for s in steps)
    ref = doc["best_static_staleness_1"]  # the one-step-off best-static of the same job, for the gain
    assert ref["samples_per_s"] > 0 and isinstance(ref["rollout_devices"], int)
    assert "streaming pipeline, staleness 2, partial rollout" in capsys.readouterr().out


def test_simulate_pipeline_flags_are_checked(tmp_path, capsys):
    assert main(["simulate", "--workload", "short-tail", "--partial", "--out", str(tmp_path)]) == 2
    assert "partial rollout needs staleness" in capsys.readouterr().err
    assert main(["simulate", "--workload", "short-tail", "--staleness", "0", "--out", str(tmp_path)]) == 2
    assert "staleness=0" in capsys.readouterr().err
    assert main(["simulate", "--workload", "short-tail", "--staleness", "2", "--policies", "hysteresis,lend",
                 "--out", str(tmp_path)]) == 2
    assert "one-step-off pipeline only" in capsys.readouterr().err
