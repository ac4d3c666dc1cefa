"""`dynaresize bench resize --lora-rank` end to end on a tiny model: the LoRA moves carry the
adapter's shards (bytes per move within 10% of the arithmetic), far fewer bytes than the full
moves at the same bound, and the adapter state survives them. No timing asserts."""

import argparse
import json

import pytest
import ray

from dynaresize.commands import bench_resize
from dynaresize.commands.bench_resize_report import bench_adapter_params
from dynaresize.config import ReshardConfig

pytestmark = pytest.mark.dist


@pytest.mark.slow  # ~2-3 min: starts the workers three times (full, naive restart, LoRA)
def test_bench_resize_lora_beside_full(tmp_path):
    primary = ReshardConfig().staging_bytes
    args = argparse.Namespace(devices=3, params=2e5, repeats=1, out=str(tmp_path), staging_bounds=(primary,),
                              naive_moves=1, lora_rank=4)
    try:
        rc = bench_resize.main(args)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    b = s["lora"]
    a = b["adapter_params"]
    assert a == b["adapter_params_arithmetic"] == bench_adapter_params(s["model"], 4, ("all-linear",))
    assert b["rank"] == 4 and b["staging_bound_bytes"] == primary and b["state_preserved"] is True
    d = b["by_direction"]
    # 1 rollout / 2 train <-> 2 / 1: the joining trainer receives half the adapter's parameters
    # and moments (12 B each); the leaving one's shard goes to the other trainer, and its engine
    # gets the adapter (fp32 on the CPU engine) with the step's sync
    assert d[bench_resize.TO_TRAIN]["bytes_median"] == pytest.approx(12 * a / 2, rel=0.1)
    assert d[bench_resize.TO_ROLLOUT]["bytes_median"] == pytest.approx(12 * a / 2 + 4 * a, rel=0.1)
    for v in d.values():
        assert v["num_resizes"] == 1 and v["critical_s_median"] > 0
        assert v["bytes_median"] * 4 < v["full_bytes_median"]
    lora_records = [json.loads(x) for x in (tmp_path / "records-lora.jsonl").read_text().splitlines()]
    assert len([r for r in lora_records if r["kind"] == "resize"]) == len(b["resizes"]) == 4
