"""Tiny Qwen3-MoE, Qwen2-MoE (a gated shared expert too) and Mixtral folders in a real vLLM
engine (CPU build, in a process of its own): the engine names its stacked experts and router
gates as the trainer does, the weights read back from it (digest) are the trainer's, its
log-probs equal the HF model's recompute, and after an in-place reload of new weights both hold
again (vLLM's CPU reload leaves the experts unpacked: roles/vllm_moe.py prepacks them again).
Mixtral's MoE layer has other names in vLLM (`block_sparse_moe`, w1/w3/w2): the engine takes
and reports the trainer's names all the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.slow]  # ~50 s each: vLLM's import and start

SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model
from dynaresize.roles.base import GenRequest
from dynaresize.roles.rollout_vllm import VLLMRolloutEngine
from dynaresize.roles.vllm_weights import state_dict_digest

cfg = ModelConfig(path=sys.argv[1])
model = build_model(cfg)
T = 0.8

def hf_logprobs(req, res):
    ids = torch.tensor([list(req.prompt_ids) + list(res.response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / T
    lp = torch.log_softmax(logits, -1)
    n = len(req.prompt_ids)
    return [float(lp[n - 1 + i, t]) for i, t in enumerate(res.response_ids)]

def check(eng):
    reqs = [GenRequest((0, p, s), [5 + p, 40 + 3 * p, 77, 12][: 2 + p], 12, 1000 * p + s) for p in range(2) for s in range(2)]
    out = eng.generate(reqs)
    gaps = [max(abs(a - b) for a, b in zip(r.logprobs, hf_logprobs(q, r))) for q, r in zip(reqs, out) if r.response_ids]
    names = eng.weight_names()
    sd = model.state_dict()
    return {"digest_equal": eng.weights_digest() == state_dict_digest(sd, names),
            "max_logprob_gap": max(gaps), "tokens": sum(len(r.response_ids) for r in out)}

eng = VLLMRolloutEngine(cfg, T, kv_cache_bytes=32 << 20, max_model_len=128, prefix_caching=False)
eng.start({k: v.detach().clone() for k, v in model.state_dict().items()}, 0)
out = {"names": eng.weight_names(), "first": check(eng)}
with torch.no_grad():
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))
eng.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, 1)
out["reloaded"] = check(eng)
eng.release()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_engine_holds_and_computes_with_the_trainer_weights(family, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _moe_model import write_moe_model

    folder = write_moe_model(tmp_path / family, family)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, env=env,
                          timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert "model.layers.0.mlp.experts.gate_up_proj" in out["names"] and "model.layers.1.mlp.gate.weight" in out["names"]
    for phase in ("first", "reloaded"):
        assert out[phase]["digest_equal"], out
        assert out[phase]["tokens"] > 0 and out[phase]["max_logprob_gap"] < 1e-4, out
