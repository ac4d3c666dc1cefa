"""`dynaresize bench resize`: measured resize costs, optimized vs naive, on real workers.

One run starts a `Cluster` (Ray actors, one gloo world) with a Qwen2 model sized to about
`--params` parameters, trains one step (so the optimizer moments are real), then moves one
device back and forth between the pools, in both directions, by both paths:
- optimized: `Cluster.resize` (cached communicators, bounded-staging reshard, optimizer moments
  in the background) followed by `finish_background`;
- naive: `cluster.naive.naive_resize` (checkpoint to disk, kill every worker, new processes,
  new world, reload at the new training size, rebuild engines).
A naive restart is also how the run switches the staging bound (`reshard.staging_bytes`): the
restarted workers get the next bound of the sweep, the last (the primary: the configured
default) gets `--repeats` round trips, the others one each, each segment after one warm-up
round trip that is recorded but left out of the medians (fresh processes pay lazy imports on
their first move; a real run's workers have run both roles before they move). The primary
bound's numbers are the headline.

Outputs in DIR (written by commands/bench_resize_report.py): `summary.json` (keys documented in docs/resize.md), `records.jsonl` (`resize`
and `op` records, naive phases as ops with `path: naive`), `resize_timeline.png` (op timeline
of one optimized resize per direction and one naive resize, critical ops in red).

With `--lora-rank R` the same run then starts a second cluster training a LoRA adapter of rank
R on all-linear (`train.lora`) and moves a device back and forth at the primary bound
(`--repeats` round trips after a warm-up, optimized path only): `summary.json`'s `lora` block
and the table set its critical path and bytes per move beside the full-training moves'
(`bench_resize_report.lora_summary`), with the adapter's size from `costmodel.lora` beside the
trainers' own count. Its records go to `records-lora.jsonl`.

Checks made here, not assumed: the trainer state (parameters, both moments, step) read back
from a checkpoint after every move equals the one before the first move (`state_preserved`),
and every op's staging peak stays within its bound.

Peak staging of a parameter move: the op dicts of `Cluster.resize` carry `peak_staging_bytes`
when the cluster surfaces it; otherwise it is derived from the same transfer plan the worker
executes (`peak_staging_source` says which). Moment moves report the worker's own figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from dynaresize.commands.bench_resize_report import (KIB, MIB, fmt_bytes, format_lora, format_table, lora_summary,
                                                     plot_timeline, summarize)
from dynaresize.errors import UserError

SWEEP_BYTES = (64 * KIB, 16 * MIB)  # then the primary (configured default) bound
TO_ROLLOUT, TO_TRAIN = "train->rollout", "rollout->train"


def model_for_params(num_params: float) -> dict:
    """A built-in Qwen2 `model` config section of about `num_params` trainable parameters
    (per layer 16*H^2 + 5*H with the MLP at 4*H, plus untied embedding and head 2*V*H)."""
    if not num_params > 0:
        raise UserError(f"--params: must be > 0, got {num_params}")
    layers, vocab = (8, 8192) if num_params >= 1e7 else (4, 2048) if num_params >= 1e6 else (2, 512)
    b = 2 * vocab + 5 * layers + 1
    h = (-b + math.sqrt(b * b + 64 * layers * num_params)) / (32 * layers)
    hidden = max(64, int(round(h / 64)) * 64)
    return {"hidden_size": hidden, "num_layers": layers, "num_heads": hidden // 64, "num_kv_heads": hidden // 64,
            "vocab_size": vocab, "tie_word_embeddings": False}


def qwen2_num_params(model: dict) -> int:
    """Trainable parameters of the built-in Qwen2 for a `model` section (rl.models.qwen2_config:
    MLP 4*H, biases on q/k/v, two norms per layer, a final norm, untied embedding and head)."""
    h, layers, vocab = model["hidden_size"], model["num_layers"], model["vocab_size"]
    return 2 * vocab * h + layers * (16 * h * h + 5 * h) + h


def _config(devices: int, model: dict, staging_bytes: int | None, overrides: list[str] = (), lora_rank: int = 0):
    from dynaresize.config_load import apply_overrides, build_config, merge

    # Start with fewer rollout than training devices, so training keeps >= 2 devices at 4+.
    data: dict = {"cluster": {"devices": devices, "rollout_devices": max(1, (devices - 1) // 2)}, "model": model}
    if staging_bytes is not None:
        data["reshard"] = {"staging_bytes": int(staging_bytes)}
    if lora_rank:
        data["train"] = {"lora": {"rank": int(lora_rank)}}
    cfg = build_config(merge(data, apply_overrides({}, list(overrides))))
    if cfg.rollout.tensor_parallel != 1:  # the bench moves one device at a time
        from dynaresize.errors import ConfigError

        raise ConfigError([f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}: `bench resize` moves one "
                           "device at a time; it measures TP1 replicas only"])
    return cfg


def _train_once(cluster, cfg) -> None:
    """One real training step, so moments and step counters are not their initial zeros."""
    from dynaresize.rl import grpo

    rng, vocab = random.Random(0), cfg.model.vocab_size
    samples = [grpo.TrainSample(sample_id=(0, i // 4, i % 4), prompt_ids=[2, 5, 6, 7],
                                response_ids=[rng.randrange(4, vocab) for _ in range(8)],
                                rollout_logprobs=[-2.0] * 8, advantage=1.0 if i % 2 else -1.0) for i in range(8)]
    cluster.train(0, grpo.micro_batches(samples, cfg.train.micro_batch_size), grpo.total_response_tokens(samples))


def _read_state(directory: Path, numel: int) -> dict:
    from dynaresize.roles import checkpoint as ckpt

    reader = ckpt.CheckpointReader(directory)
    state = {k: reader.read(k, 0, numel) for k in ckpt.STATE_KEYS}
    state["step"] = int(ckpt.decode_scalars(reader.manifest["scalars"])["step"])
    return state


def _same_state(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[k], b[k]) if k != "step" else a[k] == b[k] for k in a)


def _state_preserved(cluster, ref_dir: Path, end_dir: Path, numel: int) -> bool:
    """Checkpoint the trainer state after the moves and compare it with `ref_dir`'s (before)."""
    cluster.save_checkpoint(str(end_dir))
    return _same_state(_read_state(ref_dir, numel), _read_state(end_dir, numel))


def _close(cluster, bench: "_Bench", *dirs: Path) -> None:
    """Stop the workers, close the records and remove the state checkpoints `dirs`."""
    cluster.stop()
    bench.recorder.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class _Bench:
    """The run's state: cluster, counters, measured resizes (see the module docstring)."""

    def __init__(self, devices: int, model: dict, out: Path, records: str = "records.jsonl") -> None:
        from dynaresize.records import Recorder

        self.devices, self.model, self.out = devices, model, out
        self.recorder = Recorder(out / records)
        self.t0 = time.time()
        self.resizes: list[dict] = []
        self.naive: list[Any] = []
        self.next_id = 0
        self.initial_rollout = max(1, (devices - 1) // 2)
        self.step = 1  # every move happens after the one training step (version 1 weights)

    def _emit(self, res: dict, ops: list[dict], plan) -> None:
        self.recorder.emit("resize", resize_id=res["resize_id"], step=self.step, **{"from": plan.src.to_json()},
                           to=plan.dst.to_json(), moving=list(plan.moving), to_role=plan.to_role,
                           critical_s=res["critical_s"], total_s=res["total_s"], path=res["path"],
                           staging_bytes=res.get("staging_bytes"))
        for op in ops:
            self.recorder.emit("op", resize_id=res["resize_id"], name=op["name"], device=op["device"],
                               start_s=op["t0"] - self.t0, end_s=op["t1"] - self.t0, bytes=op.get("bytes", 0),
                               critical=op["critical"], path=res["path"])

    def optimized(self, cluster, target: int, numel: int, *, warmup: bool = False) -> dict:
        import ray

        from dynaresize.control.planner import MOVE_PARAM_SHARDS, RECEIVE_PARAM_SHARDS, plan_resize

        bound = cluster.cfg.reshard.staging_bytes
        plan = plan_resize(resize_id=self.next_id, step=self.step, src=cluster.assignment, target_rollout=target)
        self.next_id += 1
        o = cluster.resize(plan, version=self.step, step=self.step, background_moments=True)
        worker_bg = {(name, d): ray.get(ref) for name, d, ref in o.background}
        cluster.finish_background(o)
        sources: set[str] = set()
        for op in o.ops:
            if op["name"] in (MOVE_PARAM_SHARDS, RECEIVE_PARAM_SHARDS) and "peak_staging_bytes" in op:
                sources.add("cluster")
            elif (op["name"], op["device"]) in worker_bg and "peak_staging_bytes" in worker_bg[op["name"], op["device"]]:
                op["peak_staging_bytes"] = int(worker_bg[op["name"], op["device"]]["peak_staging_bytes"])
                sources.add("worker")
        res = {"path": "optimized", "warmup": warmup, "resize_id": plan.resize_id, "direction": TO_ROLLOUT if plan.to_role == "rollout"
               else TO_TRAIN, "staging_bytes": bound, "critical_s": o.critical_end - o.t_decide,
               "total_s": max(op["t1"] for op in o.ops) - o.t_decide,
               "groups_created_critical": int(o.groups_created_critical),
               "peak_staging_bytes": max((int(op.get("peak_staging_bytes", 0)) for op in o.ops), default=0),
               "peak_staging_source": sorted(sources), "moving": list(plan.moving),
               "ops": [{**op, "t0": op["t0"] - o.t_decide, "t1": op["t1"] - o.t_decide} for op in o.ops]}
        self._emit(res, o.ops, plan)
        self.resizes.append(res)
        return res

    def naive_move(self, cluster, target: int, next_cfg, keep_checkpoint: bool = False):
        from dynaresize.cluster.naive import naive_resize
        from dynaresize.control.planner import plan_resize

        plan = plan_resize(resize_id=self.next_id, step=self.step, src=cluster.assignment, target_rollout=target)
        self.next_id += 1
        n = naive_resize(cluster, plan, version=self.step, step=self.step, checkpoint_root=self.out,
                         new_cfg=next_cfg, keep_checkpoint=keep_checkpoint)
        res = {"path": "naive", "resize_id": plan.resize_id, "direction": TO_ROLLOUT if plan.to_role == "rollout"
               else TO_TRAIN, "critical_s": n.critical_s, "total_s": n.critical_s,
               "groups_created_critical": n.groups_created_critical, "checkpoint_bytes": n.checkpoint_bytes,
               "phases_s": n.phase_s(), "old_pids": n.old_pids, "new_pids": n.new_pids,
               "ops": [{**p, "critical": True, "t0": p["t0"] - n.t_decide, "t1": p["t1"] - n.t_decide}
                       for p in n.phases]}
        self._emit(res, [{**p, "critical": True} for p in n.phases], plan)
        self.resizes.append(res)
        self.naive.append(n)
        return n


def _warm_reload(cluster, directory: Path, step: int) -> dict:
    """The state part of a naive restart, on processes that are already warm: reload the
    checkpoint at the current training size, rebuild the engines, sync weights."""
    import ray

    a = cluster.assignment
    t0 = time.time()
    ray.get([cluster.workers[d].load_checkpoint.remote(str(directory), a.devices("train")) for d in a.devices("train")]
            + [cluster.workers[d].start_rollout.remote(step) for d in a.devices("rollout")])
    t1 = time.time()
    cluster.sync_weights(step, step)
    return {"reload_and_engines_s": t1 - t0, "load_weights_s": time.time() - t1}


def run_lora(*, devices: int, model: dict, repeats: int, out: Path, staging_bytes: int, rank: int,
             overrides: list[str] = ()) -> dict:
    """The LoRA segment (module docstring): a fresh cluster training a rank-`rank` adapter, one
    training step, then a warm-up round trip and `repeats` measured ones at `staging_bytes`.
    Returns what `lora_summary` reads: the resizes, the trainers' adapter size (checkpoint
    manifest) and whether the adapter state read back after the moves equals the one before."""
    from dynaresize.cluster.cluster import Cluster
    from dynaresize.roles.checkpoint import read_manifest
    from dynaresize.types import Assignment

    cfg = _config(devices, model, staging_bytes, overrides, lora_rank=rank)
    bench = _Bench(devices, model, out, records="records-lora.jsonl")
    r0 = cfg.cluster.rollout_devices
    print(f"bench resize, LoRA rank {rank} ({','.join(cfg.train.lora.target_modules)}): starting workers...", flush=True)
    cluster = Cluster(cfg)
    ref_dir, end_dir = out / "lora-state-before", out / "lora-state-after"
    try:
        cluster.start(Assignment.split(devices, r0))
        _train_once(cluster, cfg)
        cluster.save_checkpoint(str(ref_dir))
        numel = int(read_manifest(ref_dir)["numel"])
        for trip in range(repeats + 1):
            for target in (r0 + 1, r0):
                r = bench.optimized(cluster, target, numel, warmup=trip == 0)
                print(f"  {'(warm-up)' if trip == 0 else 'LoRA     '} {r['direction']:15s}: critical {r['critical_s']:.3f} s, "
                      f"total {r['total_s']:.3f} s, {fmt_bytes(sum(op.get('bytes', 0) for op in r['ops']))} moved",
                      flush=True)
        preserved = _state_preserved(cluster, ref_dir, end_dir, numel)
    finally:
        _close(cluster, bench, ref_dir, end_dir)
    return {"rank": rank, "target_modules": list(cfg.train.lora.target_modules), "numel": numel,
            "resizes": bench.resizes, "state_preserved": preserved}


def run_bench(*, devices: int, num_params: float, repeats: int, out: Path, bounds: tuple[int, ...] | None = None,
              naive_moves: int | None = None, overrides: list[str] = (), lora_rank: int = 0) -> dict:
    """Run the benchmark (module docstring); returns the summary (also written to out)."""
    from dynaresize.cluster.cluster import Cluster
    from dynaresize.config import ReshardConfig
    from dynaresize.roles.checkpoint import read_manifest
    from dynaresize.types import Assignment

    if devices < 3:
        raise UserError(f"--devices: need at least 3 (a move each way keeps a device in each pool), got {devices}")
    if repeats < 1:
        raise UserError(f"--repeats: must be >= 1, got {repeats}")
    if lora_rank < 0:
        raise UserError(f"--lora-rank: must be >= 1 (0: no LoRA segment), got {lora_rank}")
    primary = ReshardConfig().staging_bytes
    bounds = tuple(bounds) if bounds else SWEEP_BYTES + (primary,)
    primary = bounds[-1]
    num_naive = naive_moves if naive_moves is not None else max(2, len(bounds) - 1)
    if num_naive < max(1, len(bounds) - 1):
        raise UserError(f"naive moves: {num_naive} cannot switch through {len(bounds)} staging bounds")
    model = model_for_params(num_params)
    out.mkdir(parents=True, exist_ok=True)
    bench = _Bench(devices, model, out)
    cfgs = [_config(devices, model, b, overrides) for b in bounds]
    numel = qwen2_num_params(model)  # replaced below by the trainers' own count (checkpoint manifest)
    r0 = cfgs[0].cluster.rollout_devices
    print(f"bench resize: {devices} devices, Qwen2 {numel / 1e6:.2f}M params {model}; bounds "
          f"{[fmt_bytes(b) for b in bounds]}; starting workers...", flush=True)
    cluster = Cluster(cfgs[0])
    t = time.time()
    ref_dir, end_dir = out / "state-before", out / "state-after"
    try:
        cluster.start(Assignment.split(devices, r0))
        start_s = time.time() - t
        _train_once(cluster, cfgs[0])
        cluster.save_checkpoint(str(ref_dir))
        numel = int(read_manifest(ref_dir)["numel"])
        seg, naive_done, warm = 0, 0, None
        while True:
            pairs = repeats if seg == len(bounds) - 1 else 1
            # A round trip: away from the current split and back. The first one after a (re)start
            # is a warm-up, kept but left out of the medians: in a real run the workers have
            # already run both roles' code before any move (see docs/resize.md).
            for trip in range(pairs + 1):
                back = cluster.assignment.num_rollout
                away = back + 1 if back == r0 else back - 1
                for target in (away, back):
                    r = bench.optimized(cluster, target, numel, warmup=trip == 0)
                    print(f"  {'(warm-up)' if trip == 0 else 'optimized'} {r['direction']:15s} bound {fmt_bytes(r['staging_bytes']):>8s}: critical "
                          f"{r['critical_s']:.3f} s, total {r['total_s']:.3f} s", flush=True)
            if naive_done >= num_naive:
                break
            seg = min(seg + 1, len(bounds) - 1)
            last = naive_done == num_naive - 1
            now = cluster.assignment.num_rollout
            n = bench.naive_move(cluster, r0 + 1 if now == r0 else r0, cfgs[seg], keep_checkpoint=last)
            naive_done += 1
            print(f"  naive     {bench.resizes[-1]['direction']:15s}: critical {n.critical_s:.3f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in n.phase_s().items())})", flush=True)
            if last:
                warm = _warm_reload(cluster, Path(n.checkpoint_dir), bench.step)
                shutil.rmtree(n.checkpoint_dir, ignore_errors=True)
        preserved = _state_preserved(cluster, ref_dir, end_dir, numel)
    finally:
        _close(cluster, bench, ref_dir, end_dir)
    summary = summarize(bench, numel, bounds, primary, start_s, warm, preserved, repeats)
    if lora_rank:
        seg = run_lora(devices=devices, model=model, repeats=repeats, out=out, staging_bytes=primary, rank=lora_rank,
                       overrides=overrides)
        summary["lora"] = lora_summary(seg, summary, primary)
    from dynaresize.roles.base import resolve_engine

    summary["rollout_engine"] = resolve_engine(cfgs[0])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_timeline(bench, out / "resize_timeline.png", primary)
    print(format_table(summary), flush=True)
    if lora_rank:
        print(format_lora(summary), flush=True)
    return summary


def main(args: argparse.Namespace) -> int:
    """Entry of `dynaresize bench resize` (flags from commands/bench.py; tests may add
    `staging_bounds` and `naive_moves` to `args`)."""
    out = Path(args.out or "bench-out/resize")
    if not getattr(args, "address", None):
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user Ray started by this command
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    summary = run_bench(devices=int(args.devices), num_params=float(args.params), repeats=int(args.repeats), out=out,
                        bounds=getattr(args, "staging_bounds", None), naive_moves=getattr(args, "naive_moves", None),
                        overrides=list(getattr(args, "set", None) or []), lora_rank=int(getattr(args, "lora_rank", 0) or 0))
    ok = (summary["state_preserved"] and summary["optimized"]["groups_created_critical"] == 0
          and all(b["within_bound"] for b in summary["bounds"])
          and summary.get("lora", {}).get("state_preserved", True))
    print(f"wrote {out / 'summary.json'} and {out / 'resize_timeline.png'}", flush=True)
    return 0 if ok else 1
