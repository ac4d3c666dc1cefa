"""`train.lora` on the real runtime with the HF engine, and with vLLM engines (issue 36, LoRA acceptance).

One deterministic LoRA run with a move each way (scripted: a trainer leaves for rollout after
step 1 and comes back after step 3, 4 devices) against its static run:

- every sample's tokens and the final adapter and merged weights equal the static run's (the
  run itself checks after every sync that each engine serves the trainers' adapter: digests);
- each resize's `op` records move the adapter and its moments only: their bytes are within 10%
  of the arithmetic from the adapter's shapes (the rows that change owner between the row-chunk
  layouts, fp64 master and two fp64 moments in deterministic mode, plus the whole adapter in
  fp32 for the leaving device's engine), and far below the full model's;
- each `weight_sync` record's `wire_bytes` is the adapter's in the wire dtype (fp32 here);
- the export (RUN_DIR/checkpoint) loads in transformers as the merged model and its greedy
  tokens for a prompt are those of an HF engine given the final adapter from the trainers'
  checkpoint; its adapter/ folder is peft's layout.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import job_data, ray_local, records, samples  # noqa: E402,F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~100 s: two 5-step runs on 4 CPU devices, imports
STEPS = 5
LORA = {"rank": 4, "alpha": 8.0}


def _config(policy: dict, engine: str = "hf"):
    from dynaresize.config_load import build_config, merge

    rollout = {"engine": engine, **({"vllm_kv_cache_bytes": 64 << 20} if engine == "vllm" else {})}
    return build_config(merge(job_data(steps=STEPS), {"train": {"lora": LORA, "lr": 2e-2}, "policy": policy,
                                                      "rollout": rollout}))


# vllm: its engines are sent the adapter and serve the merged weights (roles/vllm_lora.py)
@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def runs(ray_local, tmp_path_factory, request):  # noqa: F811
    from dynaresize.driver.run import run_job

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    base = tmp_path_factory.mktemp("lora")
    out = {}
    for name, policy in (("moves", {"schedule": "2:3,4:2"}), ("static", {"name": "static"})):
        summary = run_job(_config(policy, request.param), base / name, progress=False)
        assert summary["ledger_ok"], summary["ledger_problems"]
        assert summary["rollout_engine"] == request.param
        out[name] = (base / name, summary)
    return out


def _specs():
    from dynaresize.roles.lora_model import adapter_specs

    cfg = _config({"schedule": "2:3,4:2"})
    return cfg, list(adapter_specs(cfg.model, cfg.train.lora))


def _moved_bytes(specs, old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """Bytes the trainers' adapter state (fp64 param + two fp64 moments) moves from the row-chunk
    layout over `old` to the one over `new`: the rows whose owner changes."""
    moved = 0
    for _, shape in specs:
        rows, cols = shape[0], math.prod(shape[1:])
        owner = lambda r, ranks: ranks[r // math.ceil(rows / len(ranks))]  # noqa: E731
        moved += sum(cols for r in range(rows) if owner(r, old) != owner(r, new))
    return moved * 8 * 3


def test_lora_run_with_moves_equals_its_static_run(runs):
    from safetensors.torch import load_file

    (moves, s1), (static, s2) = runs["moves"], runs["static"]
    assert s1["resizes_to_rollout"] == 1 and s1["resizes_to_train"] == 1 and s2["resizes_to_rollout"] == 0
    got = {k: r["token_sha1"] for k, r in samples(moves).items()}
    want = {k: r["token_sha1"] for k, r in samples(static).items()}
    assert got == want and len(want) == STEPS * 16
    for rel in ("checkpoint/model.safetensors", "checkpoint/adapter/adapter_model.safetensors"):
        w1, w2 = load_file(str(moves / rel)), load_file(str(static / rel))
        assert w1.keys() == w2.keys()
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6, rel
    adapter = load_file(str(moves / "checkpoint/adapter/adapter_model.safetensors"))
    assert all(".lora_" in k for k in adapter) and any(float(t.abs().max()) > 0 for k, t in adapter.items()
                                                       if "lora_B" in k)  # it trained


def test_moves_and_syncs_carry_the_adapter_only(runs):
    from dynaresize.rl.models import build_model

    cfg, specs = _specs()
    adapter_numel = sum(math.prod(s) for _, s in specs)
    full_numel = sum(p.numel() for p in build_model(cfg.model).parameters())
    moves, _ = runs["moves"]
    resizes = records(moves, "resize")
    assert [r["to_role"] for r in resizes] == ["rollout", "train"]
    for r in resizes:
        old, new = tuple(r["from"]["train"]), tuple(r["to"]["train"])
        expected = _moved_bytes(specs, old, new) + (adapter_numel * 4 if r["to_role"] == "rollout" else 0)
        moved = sum(op["bytes"] for op in records(moves, "op") if op["resize_id"] == r["resize_id"])
        print(f"resize {r['resize_id']} to {r['to_role']}: {moved} bytes moved, arithmetic {expected}, "
              f"full-model state {full_numel * 8 * 3} bytes")
        assert abs(moved - expected) <= 0.1 * expected, (moved, expected)
        assert moved < full_numel * 8  # not even the full model's fp64 master once
    syncs = records(moves, "weight_sync")
    assert syncs and {s["wire_dtype"] for s in syncs} == {"float32"}
    assert {s["wire_bytes"] for s in syncs} == {adapter_numel * 4}, (adapter_numel, full_numel)
    print(f"weight_sync wire_bytes {adapter_numel * 4} (adapter) vs {full_numel * 4} (full model), "
          f"{len(syncs)} records")


def test_export_is_the_merged_model_with_the_engines_greedy_tokens(runs):
    import torch
    from transformers import AutoModelForCausalLM

    from dynaresize.roles.base import GenRequest
    from dynaresize.roles.checkpoint import CheckpointReader
    from dynaresize.roles.rollout_hf import HFRolloutEngine

    cfg, specs = _specs()
    moves, _ = runs["moves"]
    step_dir = sorted((moves / "checkpoint").glob("step-*"))[-1]
    reader = CheckpointReader(step_dir / "trainer")
    assert [(p["name"], tuple(p["shape"])) for p in reader.manifest["params"]] == specs  # the adapter only
    adapter = {p["name"]: reader.read("param", p["offset"], p["offset"] + math.prod(p["shape"]),
                                      dtype=torch.float32).view(p["shape"]) for p in reader.manifest["params"]}
    engine = HFRolloutEngine(cfg.model, 1e-6, batch_rows=4, lora=cfg.train.lora)
    engine.set_weights(adapter, STEPS)
    prompt = [2, 17, 41, 99, 123, 7]
    got = engine.generate([GenRequest(sample_id=(0, 0, 0), prompt_ids=prompt, max_new_tokens=12, seed=3)])[0]
    model = AutoModelForCausalLM.from_pretrained(moves / "checkpoint", dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    greedy = out[0, len(prompt):].tolist()
    assert got.response_ids == greedy[:len(got.response_ids)] and len(got.response_ids) >= 1, (got.response_ids, greedy)
