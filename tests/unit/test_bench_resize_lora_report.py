"""`bench resize --lora-rank`'s report (commands/bench_resize_report.py): the adapter's size
for the bench's model equals peft's count, and the LoRA block sets each direction's medians
beside the full-training moves' at the same staging bound."""

from __future__ import annotations

import math
import warnings

import pytest

from dynaresize.commands import bench_resize_report as rep
from dynaresize.commands.bench_resize import model_for_params


@pytest.mark.parametrize("params", [2e5, 4e7])
def test_the_bench_models_adapter_is_pefts(params):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dynaresize.config import ModelConfig
    from dynaresize.rl.models import qwen2_config

    model = model_for_params(params)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(qwen2_config(ModelConfig(**model)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = get_peft_model(hf, LoraConfig(r=16, target_modules="all-linear"))
    peft_count = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert rep.bench_adapter_params(model, 16, ("all-linear",)) == peft_count


def _resize(direction, critical, nbytes, *, warmup=False, bound=1024, path="optimized"):
    ops = [{"name": "receive_param_shards", "device": 1, "t0": 0.0, "t1": critical, "bytes": nbytes // 3,
            "critical": True},
           {"name": "receive_optimizer_shards", "device": 1, "t0": critical, "t1": critical + 0.5,
            "bytes": nbytes - nbytes // 3, "critical": False}]
    return {"path": path, "warmup": warmup, "direction": direction, "staging_bytes": bound, "critical_s": critical,
            "total_s": critical + 0.5, "ops": ops}


def test_lora_block_sets_medians_beside_the_full_moves():
    full = {"model": model_for_params(2e5), "num_params": 200_000, "resizes": [
        _resize("train->rollout", 0.4, 3_000_000), _resize("train->rollout", 0.6, 3_000_000),
        _resize("rollout->train", 0.5, 2_400_000), _resize("rollout->train", 9.0, 9, warmup=True),
        _resize("rollout->train", 7.0, 7, bound=64)]}  # another bound: not compared
    seg = {"rank": 4, "target_modules": ["all-linear"], "numel": 12_345, "state_preserved": True, "resizes": [
        _resize("train->rollout", 0.1, 30_000), _resize("train->rollout", 0.2, 30_000),
        _resize("rollout->train", 0.15, 24_000), _resize("rollout->train", 5.0, 1, warmup=True)]}
    b = rep.lora_summary(seg, full, 1024)
    t, r = b["by_direction"]["train->rollout"], b["by_direction"]["rollout->train"]
    assert t["critical_s_median"] == pytest.approx(0.15) and t["full_critical_s_median"] == pytest.approx(0.5)
    assert t["bytes_median"] == 30_000 and t["full_bytes_median"] == 3_000_000
    assert r["critical_s_median"] == 0.15 and r["full_critical_s_median"] == 0.5 and r["num_resizes"] == 1
    assert b["warmup_critical_s"] == [5.0] and b["adapter_params"] == 12_345
    assert b["adapter_params_arithmetic"] == rep.bench_adapter_params(full["model"], 4, ("all-linear",))
    text = rep.format_lora({"lora": b})
    assert "LoRA rank 4 (all-linear)" in text and "29.3 KiB / 2.861 MiB" in text
    seg["resizes"] = [_resize("train->rollout", 0.1, 30_000)]
    b = rep.lora_summary(seg, {**full, "resizes": []}, 1024)  # nothing to compare with: nan, shown as '-'
    assert math.isnan(b["by_direction"]["train->rollout"]["full_bytes_median"])
    assert " / -" in rep.format_lora({"lora": b})
