"""`dynaresize bench rollout`: the runtime's rollout path against one vLLM engine's own ceiling.

One run, two measurements of the same work (the same prompts, sample seeds and forced lengths,
`rollout.synthetic_lengths`, so the tokens do not depend on the weights):
- runtime: a static synchronous job (`train.staleness = 0`, so rollout does not share the CPU
  with training) on 2 CPU devices (1 rollout with the vLLM engine, 1 training) runs `--steps` steps; each window's rollout (its engine call dispatched through the
  router, the device worker's engine, the results back to the driver: the step record's
  `rollout_s`) against the response tokens of the step it rolled out;
- engine: a vLLM engine in this process, built the same way (`roles.factory`), given each of
  those steps' requests in one `LLM.generate` call: vLLM's own loop over all prompts at once.
Both in tokens per second; their ratio is what the runtime's dispatch, Ray and result path keep
of the engine's throughput on this machine. Writes DIR/bench-rollout.json with
`runtime_tokens_per_s`, `engine_tokens_per_s` and `ratio`, and keeps the run in DIR/run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dynaresize.errors import ConfigError


def job_config(args: argparse.Namespace):
    from dynaresize.config_load import build_config, merge
    from dynaresize.presets import preset

    return build_config(merge(preset("cpu"), {
        "steps": args.steps, "seed": 0, "cluster": {"devices": 2, "rollout_devices": 1},
        "rollout": {"engine": "vllm", "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                    "max_new_tokens": args.max_new_tokens, "synthetic_lengths": True,
                    "length_workload": "longtail-stationary", "vllm_max_num_seqs": args.prompts * args.samples},
        "model": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1},  # head size 32: vLLM's CPU minimum
        # synchronous (staleness 0): a step's rollout does not share this machine's cores with the
        # previous step's training, as it would one-step-off on 2 CPU cores (on GPUs they are apart)
        "train": {"staleness": 0}, "policy": {"name": "static"}}))


def runtime_rate(records: Path) -> tuple[int, float]:
    """(tokens, seconds) of the run's windowed rollouts: window k rolled out step k + 1."""
    from dynaresize.records import read_records

    rollout_s = {r["step"]: r["rollout_s"] for r in read_records(records, "step")}
    last = {s["sample_id"]: s for s in read_records(records, "sample")}  # the last record per sample is its state
    tokens: dict[int, int] = {}
    for sid, s in last.items():
        step = int(str(sid).split("-")[0])
        tokens[step] = tokens.get(step, 0) + int(s["num_tokens"])
    windows = [k for k in sorted(rollout_s) if k + 1 in tokens and rollout_s[k] > 0]
    return sum(tokens[k + 1] for k in windows), sum(rollout_s[k] for k in windows)


def engine_rate(cfg, steps: list[int]) -> tuple[int, float]:
    """(tokens, seconds) of one in-process vLLM engine generating each step's requests in one call."""
    from vllm.sampling_params import RequestOutputKind

    from dynaresize.driver.job import Job
    from dynaresize.rl.models import build_model
    from dynaresize.roles.factory import rollout_engine_from_config
    from dynaresize.roles.vllm_requests import vllm_request

    import torch

    torch.set_num_threads(cfg.cluster.torch_threads)  # as a device worker pins its math (cluster.torch_threads)
    job, engine = Job(cfg), rollout_engine_from_config(cfg)
    engine.start(build_model(cfg.model).state_dict(), 0)

    def generate(step: int) -> tuple[int, float]:
        pairs = [vllm_request(r, cfg.rollout.temperature) for g in job.requests(step) for r in g]
        for _, params in pairs:
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, whole
        t0 = time.perf_counter()
        outs = engine._llm.generate([p for p, _ in pairs], [s for _, s in pairs], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    try:
        generate(0)  # as the runtime's engine, warm before the measured steps (it rolled out step 0)
        done = [generate(step) for step in steps]
        return sum(t for t, _ in done), sum(s for _, s in done)
    finally:
        engine.release()


def main(args: argparse.Namespace) -> int:
    import ray

    from dynaresize.driver.run import run_job
    from dynaresize.roles.base import vllm_installed

    if not vllm_installed():
        raise ConfigError(["bench rollout: needs vLLM (make setup installs it; scripts/install_vllm.sh)"])
    cfg = job_config(args)
    out = Path(args.out or f"bench-rollout-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_job(cfg, out / "run", progress=False)
    finally:
        ray.shutdown()
    run_tokens, run_s = runtime_rate(out / "run" / "records.jsonl")
    eng_tokens, eng_s = engine_rate(cfg, list(range(1, cfg.steps)))
    if run_tokens != eng_tokens:  # forced lengths: the same work, or the comparison means nothing
        raise RuntimeError(f"bench rollout: the runtime generated {run_tokens} tokens, the engine {eng_tokens}")
    result = {"benchmark": "rollout", "requests_per_step": args.prompts * args.samples,
              "max_new_tokens": args.max_new_tokens, "steps_measured": cfg.steps - 1, "tokens": run_tokens,
              "runtime_s": run_s, "engine_s": eng_s, "runtime_tokens_per_s": run_tokens / run_s,
              "engine_tokens_per_s": eng_tokens / eng_s, "ratio": (run_tokens / run_s) / (eng_tokens / eng_s)}
    (out / "bench-rollout.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench rollout: {result['requests_per_step']} requests x {result['steps_measured']} steps, {run_tokens} tokens: "
          f"runtime {result['runtime_tokens_per_s']:.0f} tokens/s, vLLM's own generate {result['engine_tokens_per_s']:.0f} "
          f"tokens/s, ratio {result['ratio']:.2f}")
    return 0
