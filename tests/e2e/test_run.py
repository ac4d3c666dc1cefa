"""End to end: the real runtime on Ray + gloo with the tiny model (CPU).

One Ray for the module; each run creates its own device workers (as a user's run would).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from dynaresize.config_load import build_config
from dynaresize.driver.run import run_job
from dynaresize.presets import preset
from dynaresize.records import read_records

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(**over):
    data = preset("cpu")  # this machine's own speed: nothing paced
    data["cluster"] = {**data["cluster"], "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "prompts_per_step": 4, "max_new_tokens": 24}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return build_config(data)


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def deterministic_pair(ray_local, tmp_path_factory):
    """A scripted run with resizes both ways and a static run, same seed, deterministic mode."""
    base = tmp_path_factory.mktemp("det")
    common = dict(steps=8, deterministic=True)
    scripted = _cfg(policy__name="scripted", policy__schedule="2:3,4:1,6:2", **common)
    static = _cfg(policy__name="static:2", **common)
    s1 = run_job(scripted, base / "scripted", progress=False)
    s2 = run_job(static, base / "static", progress=False)
    return base / "scripted", s1, base / "static", s2


def test_scripted_run_resizes_both_ways_and_keeps_the_ledger(deterministic_pair):
    out, summary, _, _ = deterministic_pair
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["resizes_to_rollout"] >= 1 and summary["resizes_to_train"] >= 1
    # 2:3 (to rollout), 4:1 (to train), 6:2 (to rollout)
    resizes = list(read_records(out / "records.jsonl", "resize"))
    assert [len(r["to"]["rollout"]) for r in resizes] == [3, 1, 2]
    assert all(r["critical_s"] <= r["total_s"] for r in resizes)
    # one world per worker for the whole run; no group created on a resize's critical path
    assert summary["world_inits_max"] == 1
    assert summary["groups_created_critical"] == 0
    assert all(r["groups_created_critical"] == 0 for r in resizes)
    # every sample once, with the staleness bound (consumed_step - version <= 1)
    samples = list(read_records(out / "records.jsonl", "sample"))
    ids = [s["sample_id"] for s in samples]
    assert len(ids) == len(set(ids)) == 8 * 4 * 4
    assert all(0 <= s["consumed_step"] - s["version"] <= 1 for s in samples)
    # background optimizer-moment ops are recorded as such
    ops = list(read_records(out / "records.jsonl", "op"))
    assert any(o["name"].endswith("optimizer_shards") and not o["critical"] for o in ops)
    assert any(o["critical"] for o in ops)
    # One issuing thread per device (cluster/worker.py): a device that left training handed its
    # moments on and freed its memory before its first generation as a rollout device began.
    spans = [s for s in read_records(out / "records.jsonl", "span") if s["name"] == "rollout"]
    for r in resizes:
        if r["to_role"] != "rollout":
            continue
        for d in r["moving"]:
            mine = [o for o in ops if o["resize_id"] == r["resize_id"] and o["device"] == d]
            background_end = max(o["end_s"] for o in mine if o["name"] in ("move_optimizer_shards",
                                                                             "free_train_memory"))
            critical_end = max(o["end_s"] for o in mine if o["critical"])
            first = min(s["start_s"] for s in spans if s["device"] == d and s["start_s"] >= critical_end)
            assert background_end <= first, (r["resize_id"], d, background_end, first)


def test_deterministic_run_with_resizes_equals_static_run(deterministic_pair):
    out1, _, out2, _ = deterministic_pair
    sha1 = {s["sample_id"]: s["token_sha1"] for s in read_records(out1 / "records.jsonl", "sample")}
    sha2 = {s["sample_id"]: s["token_sha1"] for s in read_records(out2 / "records.jsonl", "sample")}
    assert sha1 == sha2
    w1 = _safetensors(out1 / "checkpoint" / "model.safetensors")
    w2 = _safetensors(out2 / "checkpoint" / "model.safetensors")
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert worst <= 1e-6
    # the runs really trained: weights moved from their initialisation
    from dynaresize.rl.models import build_model

    init = build_model(_cfg().model).state_dict()
    assert max(float((w1[k] - init[k]).abs().max()) for k in w1) > 1e-4


def test_run_directory_is_complete(deterministic_pair):
    out, summary, _, _ = deterministic_pair
    for name in ("config.json", "records.jsonl", "summary.json", "timeline.png", "trace.json"):
        assert (out / name).is_file(), name
    trace = json.loads((out / "trace.json").read_text())
    tracks = {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert tracks == {0, 1, 2, 3}
    saved = json.loads((out / "summary.json").read_text())
    for key in ("steps", "devices", "total_time_s", "samples_per_s", "resizes", "resizes_to_rollout",
                "resizes_to_train", "reward_first", "reward_last", "ledger_ok"):
        assert key in saved
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    gen = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 8)


def test_unpaced_run_reports_work_and_overhead_in_wall_seconds(deterministic_pair):
    out, summary, _, _ = deterministic_pair
    assert summary["emulate"] is None and summary["time_unit"] == "wall seconds" and summary["overrun_steps"] == 0
    steps = list(read_records(out / "records.jsonl", "step"))
    assert all(r["work_s"] > 0 and r["overhead_s"] >= -1e-6 and r["overrun"] is False for r in steps)
    assert sum(r["work_s"] + r["overhead_s"] for r in steps) == pytest.approx(summary["steps_time_s"], rel=1e-6)


def test_bad_config_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dynaresize", "run", "--set", "cluster.devices=x",
                           "--set", "policy.name=nope", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cluster.devices='x'" in proc.stderr and "policy.name='nope'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_bf16_with_kl_schedule_and_clipping_through_resizes(ray_local, tmp_path):
    """bf16 compute (behaviour log-probs recomputed by the trainers), KL to the reference,
    cosine schedule with warmup and gradient clipping, through a resize each way."""
    cfg = _cfg(steps=6, policy__name="scripted", policy__schedule="2:3,4:1",
               train={"lr": 5e-3, "dtype": "bf16", "kl_coef": 0.05, "lr_schedule": "cosine", "warmup_steps": 2,
                      "max_grad_norm": 1.0})
    summary = run_job(cfg, tmp_path / "r", progress=False)
    assert summary["ledger_ok"] and summary["resizes_to_rollout"] == 1 and summary["resizes_to_train"] == 1
    steps = sorted(read_records(tmp_path / "r" / "records.jsonl", "step"), key=lambda r: r["step"])
    kl, lr = [s["kl"] for s in steps], [s["lr"] for s in steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and all(k > 0 for k in kl[1:])  # policy == reference at first
    assert lr[0] < lr[1] == lr[2] > lr[3] > lr[4] > lr[5] > 0  # warmup, then cosine decay from its peak
    assert all(s["grad_norm"] > 0 and 0 <= s["clip_frac"] <= 1 and s["entropy"] > 0 for s in steps)
    by_w = {s["num_train"]: s["train_state_bytes_max"] for s in steps}
    assert set(by_w) == {1, 2, 3} and by_w[1] > by_w[2] > by_w[3]  # sharded: fewer bytes with more trainers


def test_each_engine_holds_its_whole_share_at_once(ray_local, tmp_path):
    """One-step-off, unpaced: each rollout engine gets its share of the step in one call (the
    simulator's split), not one prompt group at a time: with 16 prompts x 4 samples on 2 rollout
    devices every engine has its 32 requests in flight at once (`concurrency` records)."""
    cfg = _cfg(steps=3, policy__name="static:2",
               rollout={**preset("cpu")["rollout"], "prompts_per_step": 16, "samples_per_prompt": 4,
                        "max_new_tokens": 8, "engine": "hf"})
    summary = run_job(cfg, tmp_path / "run", progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    conc = list(read_records(tmp_path / "run" / "records.jsonl", "concurrency"))
    assert {c["step"] for c in conc} == {0, 1}  # the windows that rolled a step out (1 and 2)
    for step in (0, 1):
        mine = [c for c in conc if c["step"] == step]
        assert len(mine) == 2 and all(c["peak"] == c["requests"] == 32 for c in mine), mine
