"""`dynaresize bench resize` end to end on a tiny model: both paths run, the summary holds the
required keys, and its relations hold (bounded staging, no group created on the optimized
critical path, new processes on the naive path, trainer state preserved). No timing asserts."""

import argparse
import json

import pytest
import ray

from dynaresize.commands import bench_resize

pytestmark = pytest.mark.dist


def test_model_for_params_reaches_the_requested_size():
    for target in (2e5, 1.5e6, 4e7, 1e8):
        model = bench_resize.model_for_params(target)
        assert model["hidden_size"] % model["num_heads"] == 0
        assert 0.5 * target <= bench_resize.qwen2_num_params(model) <= 2.0 * target, (target, model)


@pytest.mark.slow  # ~2 min: starts the workers twice; `make bench` runs the real thing
def test_bench_resize_end_to_end(tmp_path):
    bounds = (1024, 64 * 1024)  # 1 KiB: far below a parameter shard (~390 KiB here)
    args = argparse.Namespace(devices=3, params=2e5, repeats=1, out=str(tmp_path), staging_bounds=bounds,
                              naive_moves=1)
    try:
        rc = bench_resize.main(args)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    opt, naive = s["optimized"], s["naive"]
    for key in ("critical_s_median", "total_s_median"):
        assert isinstance(opt[key], float) and opt[key] > 0
    assert isinstance(naive["critical_s_median"], float) and naive["critical_s_median"] > 0
    assert s["speedup"] == pytest.approx(naive["critical_s_median"] / opt["critical_s_median"])
    assert opt["groups_created_critical"] == 0
    assert naive["groups_created_critical"] > 0  # fresh workers have no communicator to reuse
    assert s["staging_bound_bytes"] == bounds[-1]
    assert 0 < opt["peak_staging_bytes"] <= s["staging_bound_bytes"]
    assert s["param_shard_bytes_min"] > 100 * bounds[0]
    assert [b["staging_bound_bytes"] for b in s["bounds"]] == list(bounds)
    for b in s["bounds"]:
        assert b["num_resizes"] >= 2 and 0 < b["peak_staging_bytes"] <= b["staging_bound_bytes"]
    assert set(opt["by_direction"]) == {bench_resize.TO_ROLLOUT, bench_resize.TO_TRAIN}
    assert s["state_preserved"] is True
    assert s["num_params"] == bench_resize.qwen2_num_params(s["model"])  # the formula matches the real model
    for r in s["resizes"]:
        assert r["total_s"] >= r["critical_s"] > 0
        if r["path"] == "naive":
            assert not set(r["old_pids"]) & set(r["new_pids"])  # really new processes
        else:
            assert any(not op["critical"] for op in r["ops"])  # moments moved in the background
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["path"] for r in records if r["kind"] == "op"} == {"optimized", "naive"}
    assert len([r for r in records if r["kind"] == "resize"]) == len(s["resizes"])
    assert (tmp_path / "resize_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("naive-resize-*"))  # checkpoints cleaned up
