"""A tiny Qwen3-MoE folder (random weights, its own tokenizer; tests/_moe_model.py) trains on
FSDP2 and generates with the vLLM engine and with the HF engine: a move each way, ledger ok,
and in deterministic mode every sample's tokens and the final weights equal the static run's.
A folder whose module types the vLLM weight path cannot map is one line, exit 2, nothing
written (roles/engine_map.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _moe_model import write_moe_model, write_unmappable_model  # noqa: E402

pytestmark = pytest.mark.dist
STEPS, PROMPTS, SAMPLES = 5, 4, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_moe_model(tmp_path_factory.mktemp("moe") / "qwen3moe")


def _pair(folder: Path, engine: str, base: Path) -> dict:
    """The scripted run (a move to rollout after step 1, back after step 3) and the static run."""
    import ray

    from dynaresize.config_load import build_config, merge
    from dynaresize.driver.run import run_job
    from dynaresize.presets import preset

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    common = {"steps": STEPS, "deterministic": True, "cluster": {"devices": 3, "rollout_devices": 1},
              "model": {"path": str(folder)}, "task": {"chat_template": True},
              "rollout": {"engine": engine, "prompts_per_step": PROMPTS, "max_new_tokens": 12, "max_prompt_tokens": 48,
                          **({"vllm_kv_cache_bytes": 64 << 20} if engine == "vllm" else {})}}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        out = {}
        for name, policy in (("scripted", {"name": "scripted", "schedule": "2:2,4:1"}), ("static", {"name": "static:1"})):
            cfg = build_config(merge(merge(preset("user"), common), {"policy": policy}))
            out[name] = (base / name, run_job(cfg, base / name, progress=False))
        return out
    finally:
        ray.shutdown()


def _check_equal_to_static(runs: dict, engine: str, folder: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from dynaresize.records import read_records

    (d1, s1), (d2, s2) = runs["scripted"], runs["static"]
    assert s1["rollout_engine"] == s2["rollout_engine"] == engine
    assert s1["ledger_ok"] and s2["ledger_ok"] and s1["resizes_to_rollout"] == 1 and s1["resizes_to_train"] == 1
    sha1 = {s["sample_id"]: s["token_sha1"] for s in read_records(d1 / "records.jsonl", "sample")}
    sha2 = {s["sample_id"]: s["token_sha1"] for s in read_records(d2 / "records.jsonl", "sample")}
    assert sha1 == sha2 and len(sha1) == STEPS * PROMPTS * SAMPLES
    w1, w2 = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (d1, d2))
    assert any(".experts." in k for k in w1) and any(k.endswith("mlp.gate.weight") for k in w1)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6
    init = load_file(str(folder / "model.safetensors"))
    experts = [k for k in w1 if ".experts." in k]
    assert max(float((w1[k] - init[k].float()).abs().max()) for k in experts) > 1e-4  # the experts trained
    assert all(torch.isfinite(v).all() for v in w1.values())


@pytest.mark.vllm
@pytest.mark.slow  # ~3 min on 2 busy cores: two runs of 5 steps with vLLM engines (two at most)
def test_qwen3_moe_with_vllm_moves_each_way_and_equals_static(moe_dir, tmp_path):
    _check_equal_to_static(_pair(moe_dir, "vllm", tmp_path), "vllm", moe_dir)


@pytest.mark.slow  # ~1.5 min: two runs of 5 steps with the HF engine
def test_qwen3_moe_with_hf_moves_each_way_and_equals_static(moe_dir, tmp_path):
    _check_equal_to_static(_pair(moe_dir, "hf", tmp_path), "hf", moe_dir)


@pytest.mark.vllm
def test_a_module_type_vllm_cannot_map_is_one_line_exit_2(tmp_path):
    folder = write_unmappable_model(tmp_path / "gpt2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "dynaresize", "run", "--no-progress", "--preset", "user",
                           "--set", f"model.path={folder}", "--set", "rollout.engine=vllm",
                           "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "Conv1D" in lines[0] and str(folder) in lines[0] and "rollout.engine=hf" in lines[0]
    assert not (tmp_path / "r").exists()
