"""costmodel/lora.py: the adapter arithmetic, by hand on a tiny shape and against peft's own
count of trainable parameters on real (tiny) HF models; and what it makes a move and a sync cost."""

from __future__ import annotations

import warnings

import pytest

from dynaresize.costmodel import lora

TINY = lora.DecoderShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=96)


def test_hand_counted_tiny_shape():
    # q [64, 64]: r(64 + 64); k, v [32, 64]: r(64 + 32) each; o [64, 64]: r(64 + 64);
    # gate, up [96, 64]: r(64 + 96) each; down [64, 96]: r(96 + 64). Per block at r = 1:
    per_block = 128 + 96 + 96 + 128 + 160 + 160 + 160
    assert lora.adapter_params(TINY, 1) == 2 * per_block == 1856
    assert lora.adapter_params(TINY, 8) == 8 * 1856
    assert lora.adapter_params(TINY, 4, ("q_proj", "v_proj")) == 2 * 4 * (128 + 96)
    assert lora.move_bytes(1000) == 12_000 and lora.state_bytes(1000) == 16_000 and lora.sync_bytes(1000) == 2000
    with pytest.raises(ValueError, match="qkv_proj"):
        lora.adapter_params(TINY, 4, ("qkv_proj",))
    with pytest.raises(ValueError, match="rank=0"):
        lora.adapter_params(TINY, 0)


def test_qwen2_7b_shapes():
    # Qwen2-7B / Qwen2.5-7B: hidden 3584, 28 heads, 4 KV heads, head dim 128, MLP 18944, 28 layers:
    # per block r(7 x 3584 + 2 x 3584 + 2 x 512 + 3 x 18944) = 90,112 r.
    q7 = lora.DecoderShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                           intermediate_size=18944)
    assert lora.adapter_params(q7, 16) == 28 * 90_112 * 16 == 40_370_176
    assert lora.adapter_params(q7, 64) == 161_480_704


def _peft_trainable(model, rank: int, targets) -> int:
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes about rank_pattern keys of other architectures
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("rank,targets", [(4, ("all-linear",)), (8, ("q_proj", "k_proj", "down_proj"))])
def test_equals_peft_on_dense_models(family, rank, targets):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    targets_arg = "all-linear" if targets == ("all-linear",) else list(targets)
    assert _peft_trainable(model, rank, targets_arg) == lora.adapter_params(TINY, rank, targets)


def test_equals_peft_on_qwen3_moe_all_linear():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = lora.DecoderShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                              moe_intermediate_size=32)
    # By hand at r = 4: attention 4(128 + 96 + 96 + 128) = 1792; router 4(64 + 4) = 272; experts'
    # gate_up 4 x 8(64 + 64) = 4096; down 4 x 4(32 + 64) = 1536. Two blocks.
    assert lora.adapter_params(shape, 4) == 2 * (1792 + 272 + 4096 + 1536)
    assert _peft_trainable(model, 4, "all-linear") == lora.adapter_params(shape, 4)


# ------------------------------------------------------------------ the cost model, simulator, emulator

A7 = 40_370_176  # the 7b preset (Qwen2.5-7B shapes) at rank 16, all-linear (test_qwen2_7b_shapes)


def test_a_lora_moves_shards_and_syncs_are_the_adapters():
    from dynaresize.costmodel import costs

    full = costs.get_model("7b")
    lo = costs.with_lora(full, 16)
    assert lo.adapter_params == A7 and lo.trainable_params == A7 and full.trainable_params == full.num_params
    kw = dict(num_train_before=8, num_train_after=7, num_moving=1)
    for model, n in ((full, full.num_params), (lo, A7)):
        assert costs.op_cost("move_param_shards", model, **kw)[1] == pytest.approx(4 * n / 8)
        assert costs.op_cost("receive_optimizer_shards", model, **kw)[1] == pytest.approx(8 * n / 7)
    assert costs.sync_bytes(lo) == costs.sync_bytes(lo, full=True) == 2 * A7  # bf16, whole, a joining engine too
    assert costs.sync_s(lo) == pytest.approx(lo.sync_alpha_s + 2 * A7 / lo.sync_bw)
    assert costs.sync_s(lo) < costs.sync_s(full)
    assert costs.op_cost("load_weights", lo, **kw)[0] == lo.engine_wake_s  # its base is resident
    # the parameter op waits for the base rows of the new layout, read from the folder (not moved)
    assert costs.op_cost("move_param_shards", lo, **kw)[0] == pytest.approx(
        4 * A7 / 8 / costs.Hardware().nic_bw + 2 * full.num_params / 7 / costs.Hardware().pcie_h2d_bw)
    assert lo.train_state_bytes == 16 * A7 and lo.trainer_held_bytes == 16 * A7 + 4 * full.num_params
    assert costs.min_train_devices(lo) == 1 < costs.min_train_devices(full) == 3
    assert costs.naive_resize_cost(lo, 64).bytes_moved == 2 * 16 * A7 + 2 * full.num_params
    assert costs.train_flops(lo, 1000, 0) == pytest.approx((4 * full.num_params + 6 * A7) * 1000 * (4 / 3))
    with pytest.raises(costs.ConfigError, match="weight_sync='delta'"):
        costs.with_lora(costs.with_sync(full, "delta"), 16)
    with pytest.raises(costs.ConfigError, match="lora_target_modules=c_attn"):
        costs.with_lora(full, 16, ("c_attn",))
    assert costs.with_lora(lo, 0) == full


def test_the_simulator_pays_the_adapters_move_cost():
    from dynaresize.config import PolicyConfig
    from dynaresize.costmodel.scenarios import workload_scenario
    from dynaresize.records import read_records
    from dynaresize.sim.resize import canonical_timing
    from dynaresize.sim.shell import simulate

    cfg = PolicyConfig(schedule="0:44,2:40,4:44")  # 44 -> 40 rollout devices (4 join training) and back
    runs = {}
    for rank in (0, 16):
        sc = workload_scenario("longtail-drift", num_devices=64, num_steps=6, lora_rank=rank)
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            doc = simulate(sc, ["scripted"], cfg, out_dir=out)
            resizes = list(read_records(f"{out}/scripted/records.jsonl", "resize"))
            ops = list(read_records(f"{out}/scripted/records.jsonl", "op"))
        runs[rank] = (sc, doc, resizes, ops)
    (full_sc, _, full_rs, _), (lo_sc, lo_doc, lo_rs, lo_ops) = runs[0], runs[16]
    assert [r["to_role"] for r in lo_rs] == ["train", "rollout"] and len(full_rs) == 2
    for r, f in zip(lo_rs, full_rs):
        t = canonical_timing(lo_sc.model, 64, len(r["from"]["rollout"]), len(r["to"]["rollout"]), lo_sc.hardware)
        assert r["bytes"] == pytest.approx(t.bytes_moved) and r["critical_s"] == pytest.approx(t.critical_s)
        # 4 devices' shares of the adapter's fp32 parameters and moments at 24 trainers: received
        # when they join (20 -> 24 trainers), sent when they leave (24 -> 20)
        assert r["bytes"] == pytest.approx(4 * 12 * A7 / 24)
        assert r["bytes"] * 150 < f["bytes"] and r["critical_s"] < f["critical_s"]
    assert sum(o["bytes"] for o in lo_ops) == pytest.approx(sum(r["bytes"] for r in lo_rs))
    assert lo_doc["bounds"]["min_train"] == 1


def test_the_emulator_paces_a_lora_run_as_the_simulator_models_it():
    from dynaresize.config_load import build_config, merge
    from dynaresize.costmodel import costs
    from dynaresize.emulate.model import Emulator, run_bounds
    from dynaresize.errors import ConfigError
    from dynaresize.presets import preset

    def cfg(lora, rollout_devices=4):
        extra = {"train": {"lora": lora}} if lora else {}
        return build_config(merge(preset("cpu"), {"cluster": {"devices": 8, "rollout_devices": rollout_devices,
                                                              "emulate": "h100:7b"}, **extra}))

    lo, full = Emulator.from_config(cfg({"rank": 16})), Emulator.from_config(cfg(None))
    assert lo.model.lora_rank == 16 and lo.model.adapter_params == A7 and full.model.lora_rank == 0
    assert lo.sync_s == costs.sync_s(costs.with_lora(costs.get_model("7b"), 16)) < full.sync_s
    kw = dict(num_train_before=2, num_train_after=3, num_moving=1)
    assert lo.op_s("receive_optimizer_shards", **kw) < full.op_s("receive_optimizer_shards", **kw)
    assert run_bounds(cfg({"rank": 16})).min_train == 1 < run_bounds(cfg(None)).min_train == 3
    assert cfg({"rank": 16}, rollout_devices=6).cluster.rollout_devices == 6  # 2 trainers hold a 7B's adapter job
    with pytest.raises(ConfigError, match="rollout_devices=6"):
        cfg(None, rollout_devices=6)
    with pytest.raises(ConfigError, match="train.lora.target_modules=c_attn"):
        cfg({"rank": 16, "target_modules": ["c_attn"]})


def test_the_memory_plan_holds_the_frozen_base_and_the_adapters_state():
    import sys
    from pathlib import Path

    from dynaresize.costmodel import memory

    sys.path.insert(0, str(Path(__file__).parent))
    from _shapes import QWEN2_7B

    n = QWEN2_7B.num_params
    full = memory.MemoryInputs(micro_batch_size=4, seq_tokens=640, reference=True)
    lo = memory.MemoryInputs(micro_batch_size=4, seq_tokens=640, reference=True, adapter_params=A7)
    p = memory.trainer_peak(QWEN2_7B, lo, 2).as_dict()
    assert p["parameters"] == 4 * (n + A7) / 2 and p["gradients"] == 4 * A7 / 2 and p["moments"] == 8 * A7 / 2
    assert "reference" not in p  # the base with its adapter disabled is the reference
    assert "reference" in memory.trainer_peak(QWEN2_7B, full, 2).as_dict()
    assert lora.trainer_bytes(n, A7) == 4 * n + 16 * A7
    ops = memory.op_peaks(QWEN2_7B, lo, 80e9, 2)
    assert ops["leave_training"].as_dict()["train_state"] == (4 * n + 16 * A7) / 2
    # one 80 GB trainer holds a 7B LoRA job (31 GB of state); full training needs more than one
    assert memory.trainer_peak(QWEN2_7B, lo, 1).total < 80e9 < memory.trainer_peak(QWEN2_7B, full, 1).total
    with pytest.raises(ValueError, match="adapter_params=-1"):
        memory.MemoryInputs(micro_batch_size=1, seq_tokens=8, adapter_params=-1)


def test_a_run_configs_memory_inputs_count_its_adapter():
    from dynaresize.commands.memory_plan import inputs_of
    from dynaresize.config_load import build_config, merge
    from dynaresize.presets import preset

    cfg = build_config(merge(preset("cpu"), {"train": {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}}))
    m = cfg.model
    q, kv = m.hidden_size, m.num_kv_heads * (m.hidden_size // m.num_heads)
    assert inputs_of(cfg).adapter_params == m.num_layers * 4 * ((m.hidden_size + q) + (m.hidden_size + kv))
    assert inputs_of(build_config(preset("cpu"))).adapter_params == 0
