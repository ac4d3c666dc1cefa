"""A weight sync's stream of buckets into a real vLLM engine (CPU build, in a process of its
own): one `reload_weights` over 21 buckets of the tiny Qwen2 loads exactly the weights sent
(digest read back from the engine) while at most two buckets are alive outside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.slow]  # ~30 s: vLLM's import and start

SCRIPT = r"""
import json, os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model
from dynaresize.roles.rollout_vllm import VLLMRolloutEngine
from dynaresize.roles.vllm_weights import state_dict_digest
from dynaresize.roles.weight_sync import Staging, flatten, host_weights

shape = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=2048)
cfg = ModelConfig(**shape)
eng = VLLMRolloutEngine(cfg, 1.0, kv_cache_bytes=64 << 20, max_model_len=64)
eng.start(build_model(cfg).state_dict(), 0)
named = {n: p.detach() for n, p in build_model(ModelConfig(**shape, init_seed=5)).named_parameters()}
specs = [(n, tuple(p.shape)) for n, p in named.items()]
flat = flatten(named, specs)
st = Staging()
eng.set_weights(host_weights(specs, lambda lo, hi: flat[lo:hi], dtype=torch.float32, pin=False,
                             bucket_bytes=96 << 10, staging=st), 1)
names = [n for n, _ in specs]
out = {"buckets": st.num_buckets, "peak": st.peak_bytes, "largest": st.largest_bucket_bytes,
       "live_after": st.live_bytes, "equal": eng.weights_digest(names) == state_dict_digest(named, names),
       "old_equal": eng.weights_digest(names) == state_dict_digest(build_model(cfg).state_dict(), names),
       "version": eng.version}
eng.release()
print("RESULT " + json.dumps(out))
"""


def test_a_stream_of_buckets_loads_the_vllm_engine_exactly():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["equal"] and not r["old_equal"] and r["version"] == 1
    assert r["buckets"] >= 10 and r["live_after"] == 0
    assert r["peak"] <= 2 * r["largest"]
