"""`dynaresize simulate --lora-rank`: a LoRA job beside the same job training every weight."""

import json

import pytest

from dynaresize.cli import main
from dynaresize.records import read_records


def test_simulate_a_lora_job_beside_full_training(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "longtail-drift", "--devices", "64", "--steps", "12", "--lora-rank", "16",
               "--policies", "best-static,hysteresis", "--out", str(out), "--quiet", "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "summary.json").read_text())
    b = doc["lora"]
    assert b["rank"] == 16 and b["target_modules"] == ["all-linear"] and b["adapter_params"] == 40_370_176
    assert b["move_state_bytes"] == 12 * 40_370_176 and b["full_move_state_bytes"] == 12 * 7.62e9
    assert b["sync_bytes"] == 2 * 40_370_176 < b["full_sync_bytes"] and b["sync_s"] < b["full_sync_s"]
    assert b["min_train"] == doc["bounds"]["min_train"] == 1 < b["full_min_train"] == 3
    for key in ("train_to_rollout", "rollout_to_train"):  # the same move, at the same splits, in both jobs
        mine, full = doc["resize_cost_model"][key], b["full_resize_cost_model"][key]
        assert (mine["from_rollout"], mine["to_rollout"]) == (full["from_rollout"], full["to_rollout"])
        assert mine["bytes"] * 150 < full["bytes"]
    full_sps = {r["policy"]: r["samples_per_s"] for r in b["full_results"]}
    for r in doc["results"]:
        assert b["samples_per_s_vs_full"][r["policy"]] == pytest.approx(r["samples_per_s"] / full_sps[r["policy"]])
    # the records are the LoRA job's: its resizes carry the adapter's bytes
    for r in read_records(out / "hysteresis" / "records.jsonl", "resize"):
        assert r["bytes"] <= len(r["moving"]) * 12 * 40_370_176
    text = capsys.readouterr().out
    assert "LoRA rank 16 on all-linear: 40.37M adapter parameters" in text
    assert "weight sync per step: 0.081 GB" in text and "samples/s: best-static" in text


@pytest.mark.parametrize("flags,needle", [
    (["--lora-rank", "16", "--weight-sync", "delta"], "weight-sync=delta"),
    (["--lora-targets", "q_proj"], "lora-targets=q_proj: only with --lora-rank"),
    (["--lora-rank", "-1"], "lora-rank=-1"),
    (["--lora-rank", "8", "--lora-targets", "c_attn"], "lora_target_modules=c_attn"),
])
def test_bad_lora_flags_exit_2_in_one_line(tmp_path, capsys, flags, needle):
    rc = main(["simulate", "--workload", "longtail-drift", "--devices", "8", "--steps", "2", *flags,
               "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1


def test_a_split_only_the_lora_job_can_run_is_refused_for_the_job_beside_it(tmp_path, capsys):
    rc = main(["simulate", "--workload", "longtail-drift", "--devices", "16", "--steps", "2", "--lora-rank", "16",
               "--policies", "static:15", "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "the full-training job beside the LoRA one" in err and "static:15" in err
    assert len(err.splitlines()) == 1
