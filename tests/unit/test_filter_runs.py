"""The `dapo-filter` workload at a run's own filtered share (issue 33): `workload.filter_runs` reads
a run's step records (groups_filtered over the groups it scored), `batch_for_step` takes the
share per step, and `dynaresize simulate --filter-from RUN_DIR` simulates with it (and says so)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynaresize.errors import UserError
from dynaresize.workload import batch_for_step
from dynaresize.workload.filter_runs import filter_shares


def _run(tmp_path, rows, name="run"):
    """A run directory whose records.jsonl holds one step record per (kept, filtered, surplus)."""
    d = tmp_path / name
    d.mkdir()
    lines = [{"kind": "config", "config": {}}]
    lines += [{"kind": "step", "step": k, "gen_batches": 1, "groups_kept": kept, "groups_filtered": filtered,
               "groups_surplus": surplus} for k, (kept, filtered, surplus) in enumerate(rows)]
    (d / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_the_share_is_filtered_over_scored_groups_per_step(tmp_path):
    run = filter_shares(_run(tmp_path, [(4, 12, 0), (4, 4, 0), (4, 10, 2)]))
    assert run.shares == pytest.approx((0.75, 0.5, 10 / 16)) and run.groups == 16 + 8 + 16
    assert "3 steps" in run.describe() and "0.75 at step 0" in run.describe()


def test_what_is_not_a_filtering_run_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="no records.jsonl"):
        filter_shares(tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "records.jsonl").write_text(json.dumps({"kind": "step", "step": 0, "rollout_s": 1.0}) + "\n")
    with pytest.raises(UserError, match="no step records with groups_filtered"):
        filter_shares(plain)
    gap = _run(tmp_path, [(4, 1, 0), (4, 1, 0)], "gap")
    text = (gap / "records.jsonl").read_text().splitlines()
    (gap / "records.jsonl").write_text("\n".join([text[0], text[2]]) + "\n")  # step 0 missing
    with pytest.raises(UserError, match=r"no step record for step\(s\) 0"):
        filter_shares(gap)


def test_the_workload_takes_the_share_per_step_and_holds_the_last():
    low = [batch_for_step("dapo-filter", t, 512, 0, samples_per_prompt=16, filter_shares=(0.0, 0.0)) for t in range(4)]
    high = [batch_for_step("dapo-filter", t, 512, 0, samples_per_prompt=16, filter_shares=(0.8,)) for t in range(4)]
    modelled = batch_for_step("dapo-filter", 0, 512, 0, samples_per_prompt=16)
    assert all(b.num_gen_batches == 1 and b.trained.all() for b in low)  # nothing filtered: one batch
    assert all(b.num_gen_batches >= 4 for b in high)  # 80% filtered: ~5 batches for 32 kept groups
    assert all(int(b.trained.sum()) == 512 for b in low + high)
    # the same samples, only the filter differs: batch 0's lengths are the modelled run's
    assert np.array_equal(low[0].response_tokens, modelled.response_tokens[:512])


def test_simulate_from_a_run_uses_its_share_and_says_so(tmp_path, capsys):
    from dynaresize.cli import main

    args = ["simulate", "--workload", "dapo-filter", "--devices", "8", "--steps", "6", "--model", "qwen3-8b",
            "--accelerator", "h20", "--policies", "static:4", "--quiet", "--no-plots"]
    docs = {}
    for name, rows in (("low", [(32, 0, 0)] * 3), ("high", [(32, 96, 0)] * 3)):
        out = tmp_path / f"sim-{name}"
        assert main([*args, "--filter-from", str(_run(tmp_path, rows, name)), "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"filtered share from the run {tmp_path / name}'s own groups_filtered" in err
        docs[name] = json.loads((out / "summary.json").read_text())
    assert docs["low"]["filter_shares"] == [0.0] * 3 and docs["high"]["filter_shares"] == [0.75] * 3
    # 75% filtered: four generation batches a step where the low run has one; training is the same
    assert docs["high"]["results"][0]["total_time_s"] > 2 * docs["low"]["results"][0]["total_time_s"]
    assert main([*args, "--out", str(tmp_path / "modelled")]) == 0
    assert "filtered share modelled [A]: 30% at step 0" in capsys.readouterr().err
    assert main([*args[:2], "dapo-qwen3-8b", *args[3:], "--filter-from", str(tmp_path / "low"),
                 "--out", str(tmp_path / "x")]) == 2
    assert "filter-from=" in capsys.readouterr().err
