"""Measure the vLLM rollout engine's lifecycle beside the HF engine (numbers for docs/rollout.md).

    .venv/bin/python scripts/bench_vllm_engine.py [--model tiny|40m] [--threads 1]

One process, torch pinned to --threads, fp32 CPU. Prints one JSON line: start (fresh, then a
re-start in the same process), load_weights, release, generate (32 requests x 48 forced
tokens: vLLM vs the HF engine), log-prob gap between the engine and the trainer's recompute
(rl.grpo.response_logprobs), and RSS. Run it on an idle machine: on a shared one the times
mostly measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {
    "tiny": {},  # the built-in tiny Qwen2 (hidden 128, 4 layers, vocab 2048, ~1M params)
    "40m": {"hidden_size": 512, "num_layers": 10, "num_heads": 8, "vocab_size": 8192},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()

    import psutil
    import torch

    from dynaresize.config import ModelConfig
    from dynaresize.rl.grpo import TrainSample, response_logprobs
    from dynaresize.rl.models import build_model, num_parameters
    from dynaresize.roles.base import GenRequest
    from dynaresize.roles.rollout_hf import HFRolloutEngine
    from dynaresize.roles.rollout_vllm import VLLMRolloutEngine
    from dynaresize.roles.vllm_process import preload_vllm

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(**MODELS[args.model])
    model = build_model(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd2 = {k: v + 0.01 * torch.randn_like(v) for k, v in sd.items()}
    reqs = [GenRequest((0, i // 4, i % 4), [2] + list(range(10, 10 + 8 + i % 5)), args.tokens, 1000 + i, args.tokens)
            for i in range(args.requests)]
    rss = lambda: psutil.Process().memory_info().rss / 2**20  # noqa: E731
    out: dict = {"model": args.model, "params": num_parameters(model), "threads": args.threads,
                 "requests": args.requests, "tokens": args.tokens, "rss_mib_before": round(rss())}

    out["preload_s"] = preload_vllm()  # imports (a worker does this ahead)
    eng = VLLMRolloutEngine(cfg, 1.0, kv_cache_bytes=256 << 20)
    eng.start(sd, 0)
    out["start_fresh"] = eng.timings
    out["rss_mib_started"] = round(rss())
    t = time.perf_counter()
    res = eng.generate(reqs)
    out["generate_vllm_s"] = time.perf_counter() - t
    loads = []
    for v in range(1, 4):
        eng.load_weights(sd2 if v % 2 else sd, v)
        loads.append(eng.timings["load_s"])
    out["load_weights_s"] = loads
    gap = 0.0
    with torch.no_grad():
        for r, q in zip(res, reqs):
            s = TrainSample(r.sample_id, q.prompt_ids, r.response_ids, r.logprobs, 0.0)
            ref = response_logprobs(model, [s], temperature=1.0)[0]
            gap = max(gap, float((ref - torch.tensor(r.logprobs)).abs().max()))
    out["logprob_gap_vs_trainer"] = gap
    eng.release()
    out["release"] = eng.timings
    out["rss_mib_released"] = round(rss())
    eng.start(sd, 4)
    out["start_again"] = eng.timings
    eng.release()

    hf = HFRolloutEngine(cfg, 1.0, batch_rows=8)
    hf.set_weights(sd, 0)
    t = time.perf_counter()
    hf.generate(reqs)
    out["generate_hf_s"] = time.perf_counter() - t
    print(json.dumps(_rounded(out)))


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.3g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


if __name__ == "__main__":
    main()
