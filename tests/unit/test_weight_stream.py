"""Weights stream into the engine bucket by bucket in the engine's dtype (roles/weight_sync.py):
a receiver holds at most two buckets, whatever the model's size; fused units stay whole; the
weights an engine gets are the trainers' cast to the wire dtype, bit for bit."""

from __future__ import annotations

import weakref
from unittest import mock

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model
from dynaresize.roles.rollout_hf import HFRolloutEngine
from dynaresize.roles.weight_sync import (Staging, buckets, drain, fused_unit, host_weights, receive_weights,
                                          send_weights)


def qwen2_7b_specs() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-7B's parameters (hidden 3584, 28 layers, 4 KV heads of 128, intermediate 18944,
    vocabulary 152064, untied): 7.6e9 of them, 30.5 GB in fp32."""
    h, inter, kv, vocab = 3584, 18944, 512, 152064
    specs = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(28):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                  (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (inter, h)),
                  (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                  (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return specs + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_7b_sync_keeps_at_most_two_buckets_alive(dtype):
    specs = qwen2_7b_specs()
    numel = sum(torch.Size(s).numel() for _, s in specs)
    assert 7.6e9 < numel < 7.7e9
    received, alive_at = [], []

    def broadcast(tensor, src, group):  # the wire: what is still alive when the next bucket lands
        received.append(weakref.ref(tensor))
        alive_at.append(sum(r() is not None for r in received))

    staging, loaded = Staging(), []
    with mock.patch("torch.distributed.broadcast", broadcast):
        for chunk in receive_weights(specs, root=0, group=None, device=torch.device("meta"), dtype=dtype,
                                     staging=staging):
            loaded += [(n, tuple(t.shape), t.dtype) for n, t in chunk]  # an engine copies and lets go
    n_buckets = len(buckets(specs, elem_bytes=dtype.itemsize))
    assert len(received) == n_buckets > 20
    assert max(alive_at) <= 2  # the old receiver held all of them (115 in fp32)
    assert staging.peak_bytes <= 2 * staging.largest_bucket_bytes
    assert staging.wire_bytes == numel * dtype.itemsize  # 2 bytes a parameter for a bf16 engine
    assert loaded == [(n, s, dtype) for n, s in specs]


def test_buckets_never_split_a_fused_unit():
    specs = qwen2_7b_specs()
    assert fused_unit("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert fused_unit("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert fused_unit("model.norm.weight") == "model.norm" and fused_unit("a") == "a"
    out = buckets(specs, bucket_bytes=300 << 20, elem_bytes=2)  # gate + up: 271 MB in bf16
    assert [s for b in out for s in b] == specs
    where = {}
    for i, b in enumerate(out):
        for name, _ in b:
            where.setdefault(fused_unit(name), set()).add(i)
    assert all(len(v) == 1 for v in where.values())
    assert any(len(b) == 2 and b[0][0].endswith("gate_proj.weight") for b in out)


def _fake_wire():
    """broadcast(): the root's buckets queued, then handed to the receiver in order."""
    sent: list[torch.Tensor] = []

    def broadcast(tensor, src, group):
        if src == "root":
            sent.append(tensor.clone())
        else:
            tensor.copy_(sent.pop(0))
    return broadcast


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sync_into_the_hf_engine_is_the_trainers_weights_in_its_dtype(dtype):
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256, init_seed=3)
    trainer = build_model(cfg)
    named = list(trainer.named_parameters())
    specs = [(n, tuple(p.shape)) for n, p in named]
    wire = getattr(torch, dtype)
    with mock.patch("torch.distributed.broadcast", _fake_wire()):
        sent = send_weights(iter([(n, p.detach()) for n, p in named]), specs, root="root", group=object(),
                            is_root=True, device=torch.device("cpu"), dtype=wire, bucket_bytes=4096)
        engine = HFRolloutEngine(cfg, temperature=1.0, dtype=dtype)
        staging = Staging()
        engine.set_weights(receive_weights(specs, root="recv", group=None, device=torch.device("cpu"), dtype=wire,
                                           bucket_bytes=4096, staging=staging), version=7)
    numel = sum(p.numel() for _, p in named)
    assert sent == staging.wire_bytes == numel * wire.itemsize
    assert staging.num_buckets > 10 and staging.peak_bytes <= 2 * staging.largest_bucket_bytes
    got = dict(engine._model.named_parameters())
    assert engine.version == 7
    for n, p in named:
        assert got[n].dtype == wire and torch.equal(got[n], p.detach().to(wire)), n


def test_a_stream_must_hold_every_weight_once():
    cfg = ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=256)
    named = [(n, p.detach().clone()) for n, p in build_model(cfg).named_parameters()]
    engine = HFRolloutEngine(cfg, temperature=1.0)
    with pytest.raises(RuntimeError, match="missing"):
        engine.set_weights(iter([named[:-1]]), version=1)
    with pytest.raises(RuntimeError, match="unexpected"):
        engine.set_weights(iter([named + [("extra.weight", torch.zeros(2))]]), version=1)
    with pytest.raises(RuntimeError, match="shape"):
        engine.set_weights(iter([[(named[0][0], torch.zeros(3))]]), version=1)


def test_host_weights_stage_bucket_by_bucket_and_drain_takes_the_rest():
    specs = [(f"layers.{i}.w", (64, 64)) for i in range(8)]
    flat = torch.arange(8 * 64 * 64, dtype=torch.float32)
    reads = []

    def read(lo, hi):
        reads.append((lo, hi))
        return flat[lo:hi]

    staging = Staging()
    stream = host_weights(specs, read, dtype=torch.bfloat16, pin=False, bucket_bytes=2 * 64 * 64 * 2,
                          staging=staging)
    first = next(stream)
    assert [n for n, _ in first] == ["layers.0.w", "layers.1.w"] and first[0][1].dtype == torch.bfloat16
    assert torch.equal(first[1][1].reshape(-1), flat[4096:8192].to(torch.bfloat16))
    del first
    assert drain(stream) == 3  # the buckets an engine left
    assert reads == [(0, 8192), (8192, 16384), (16384, 24576), (24576, 32768)]
    assert staging.peak_bytes <= 2 * staging.largest_bucket_bytes == 2 * 8192 * 2
    assert staging.record(torch.bfloat16)["wire_dtype"] == "bfloat16"


def test_a_refused_prefix_cache_reset_resets_the_running_requests_too():
    """Under partial rollout requests run across a weight update and vLLM refuses a plain reset;
    the running requests are then reset too (their KV recomputed under the new weights), and a
    reset still refused is an error, never cached KV of old weights reused."""
    from dynaresize.roles.vllm_weights import reset_prefix_cache

    class LLM:
        def __init__(self, answers):
            self.answers, self.calls = list(answers), []

        def reset_prefix_cache(self, reset_running_requests=False):
            self.calls.append(reset_running_requests)
            return self.answers.pop(0)

    idle = LLM([True])
    reset_prefix_cache(idle)
    assert idle.calls == [False]  # nothing running: a plain reset, nothing preempted
    busy = LLM([False, True])
    reset_prefix_cache(busy)
    assert busy.calls == [False, True]
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        reset_prefix_cache(LLM([False, False]))
