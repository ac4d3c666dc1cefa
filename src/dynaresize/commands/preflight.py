"""`dynaresize preflight`: every byte per device, for every split the bounds allow, before start.

Takes the run's flags (`--preset`, `--config`, `--set`, `--devices`, `--rollout-devices`,
`--policy`, ...) and `--accelerator NAME[:GiB]`, reads only the model's `config.json` (a folder
holding nothing else is enough: roles/model_shape.py builds the model on the meta device) and
prints the memory plan of `costmodel.memory`: per training device (state, reference,
FSDP's gathered units, activations with and without checkpointing, logits, context and
communicators), per rollout device (weights in the engine's dtype, KV cache at
`rollout.gpu_memory_utilization`, sync staging, context and communicators), each resize op,
and which splits fit and what limits each. `--json` prints the same as one object whose
`splits` list holds `{rollout, train, fits, peak_bytes: {train, rollout}, limit, ...}`.

The plan is for the named accelerator, so a preset's emulation (`cluster.emulate`) plays no part.
`commands.memory_plan.check_at_start` is the same check where `dynaresize run` starts: on CUDA a starting split that
does not fit is a config error (exit 2, one line) and `policy.min_train` is raised to the fewest
trainers that fit (a trainer's peak falls with W and an engine's does not depend on the split,
so the splits that fit are exactly those with that many trainers or more).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from dynaresize.config import RunConfig
from dynaresize.config_load import build_config
from dynaresize.costmodel import memory
from dynaresize.costmodel.costs import HARDWARE_PRESETS, get_hardware
from dynaresize.errors import ConfigError
from dynaresize.commands.memory_plan import inputs_of, plan
from dynaresize.presets import PRESETS

GB = 1e9


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preflight", help="the memory plan: bytes per device of each role and resize op, for every split",
        description="Count every byte a device holds in each role and resize op for every split the bounds allow, "
        "from the model's config.json alone (no weights read), on --accelerator; say which splits fit and what "
        "limits each. Takes dynaresize run's config flags.")
    p.add_argument("--accelerator", required=True, metavar="NAME[:GiB]",
                   help=f"the device ({', '.join(HARDWARE_PRESETS)}); :GiB sets its memory, e.g. h100:79.6")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting config (default: default)")
    p.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override one field, e.g. --set model.path=/models/Qwen2-7B (repeatable)")
    p.add_argument("--devices", type=int, help="number of devices (cluster.devices)")
    p.add_argument("--rollout-devices", type=int, help="initial rollout pool size (cluster.rollout_devices)")
    p.add_argument("--policy", help="the policy (its bounds: policy.min_rollout, min_train, allowed_rollout)")
    p.add_argument("--deterministic", action="store_true", default=None, help="deterministic mode (fp32 engine)")
    p.set_defaults(func=main, steps=None, seed=None, schedule=None, address=None, emulate=None, time_scale=None,
                   faults=[])


def parse_accelerator(text: str) -> tuple[str, float]:
    """"h100" -> ("h100", 80e9); "h100:79.6" -> ("h100", 79.6 GiB). ConfigError (one line) otherwise."""
    name, sep, size = str(text).strip().lower().partition(":")
    hbm = get_hardware(name).hbm_bytes  # ConfigError naming the accelerator and the known ones
    if sep:
        try:
            gib = float(size)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ConfigError([f"accelerator={text!r}: the memory after ':' must be a number of GiB > 0"])
        hbm = gib * memory.GiB
    return name, float(hbm)


def resolve(args: argparse.Namespace) -> tuple[RunConfig, str]:
    """The run's config without `model.path`'s folder check (only config.json is needed here),
    and the path (or "" for the built-in model)."""
    from dynaresize.commands.run import resolve_data

    data = resolve_data(args)
    model = dict(data.get("model") or {})
    path = model.pop("path", None)
    data = {**data, "model": model, "cluster": {**(data.get("cluster") or {}), "emulate": None, "time_scale": None}}
    cfg = build_config(data)
    if path is not None:
        cfg = replace(cfg, model=replace(cfg.model, path=str(path)))
    return cfg, str(path or "")


def main(args: argparse.Namespace) -> int:
    name, hbm = parse_accelerator(args.accelerator)
    cfg, _ = resolve(args)
    from dynaresize.roles.model_shape import read_shape

    shape = read_shape(cfg.model)
    fits = plan(cfg, shape, hbm)
    inp = inputs_of(cfg)
    if args.json:
        print(json.dumps(report_json(cfg, shape, inp, name, hbm, fits), indent=1))
    else:
        print(report_text(cfg, shape, inp, name, hbm, fits))
    return 0


def report_json(cfg: RunConfig, shape: memory.ModelShape, inp: memory.MemoryInputs, name: str, hbm: float,
                fits: list[memory.SplitFit]) -> dict[str, Any]:
    engine = memory.engine_peak(shape, inp, hbm)
    return {
        "accelerator": name, "hbm_bytes": round(hbm), "devices": cfg.cluster.devices,
        "model": {"path": cfg.model.path, "num_params": shape.num_params, "num_layers": shape.num_layers,
                  "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_word_embeddings},
        "inputs": {k: getattr(inp, k) for k in inp.__dataclass_fields__},
        "activations_bytes": {"checkpointing_off": round(memory.activation_bytes(shape, inp, checkpointing=False)),
                              "checkpointing_on": round(memory.activation_bytes(shape, inp, checkpointing=True))},
        "rollout_parts": {k: round(v) for k, v in engine.parts},
        "kv_tokens": int(max(0.0, memory.engine_kv_bytes(shape, inp, hbm))
                         // (shape.kv_bytes_per_token(memory.DTYPE_BYTES[inp.engine_dtype]) / inp.tensor_parallel)),
        "splits": [s.to_json() for s in fits],
        "assumptions": assumptions(),
    }


def assumptions() -> list[str]:
    m = memory
    return [f"CUDA context {m.CUDA_CONTEXT_BYTES / m.MiB:.0f} MiB (measured by scripts/device_check.sh on one H200)",
            f"{m.COMMS_PER_DEVICE} NCCL communicators per device x {m.NCCL_COMM_BYTES / m.MiB:.0f} MiB "
            "(NCCL_BUFFSIZE 4 MiB x 2 peers x 32 channels)",
            f"vLLM reserve inside its budget {m.ENGINE_RESERVE_BYTES / GB:.1f} GB (profile-run activations, sampler)",
            f"parked engine {m.PARKED_ENGINE_BYTES / m.GiB:.0f} GiB (CUDA graphs: 1-3 GiB per vLLM)",
            "activations per token per layer counted tensor by tensor (Korthikanti et al. 2022's method; "
            "costmodel/memory.py)"]


def _gbs(x: float) -> str:
    return f"{x / GB:.1f}"


def report_text(cfg: RunConfig, shape: memory.ModelShape, inp: memory.MemoryInputs, name: str, hbm: float,
                fits: list[memory.SplitFit]) -> str:
    """The plan as tables (GB = 1e9 bytes, per device)."""
    lines = [f"dynaresize preflight: {shape.name} ({shape.num_params:,} parameters, {shape.num_layers} layers, vocab "
             f"{shape.vocab_size}) on {cfg.cluster.devices} x {name} ({_gbs(hbm)} GB each); GB = 1e9 bytes per device",
             "",
             f"Training (FSDP2, train.dtype {inp.train_dtype}, micro-batch {inp.micro_batch_size} x {inp.seq_tokens} "
             f"tokens, activation checkpointing {'on' if inp.activation_checkpointing else 'off'}"
             f"{', reference model' if inp.reference else ''}):", "",
             "| trainers | state (16 B/param / W) | reference | FSDP gathered | activations, checkpointing off "
             "| activations, checkpointing on | logits | context + comms | parked engine | peak | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    act = {c: memory.activation_bytes(shape, inp, checkpointing=c) for c in (False, True)}
    for w in sorted({s.train for s in fits}):
        p = memory.trainer_peak(shape, inp, w).as_dict()
        state = p["parameters"] + p["gradients"] + p["moments"]
        lines.append(f"| {w} | {_gbs(state)} | {_gbs(p.get('reference', 0.0))} | {_gbs(p.get('gathered', 0.0))} | "
                     f"{_gbs(act[False])} | {_gbs(act[True])} | {_gbs(p.get('logits', 0.0))} | "
                     f"{_gbs(p['context_comms'])} | {_gbs(p.get('parked_engine', 0.0))} | "
                     f"{_gbs(sum(p.values()))} | {'yes' if sum(p.values()) <= hbm else 'no'} |")
    e = memory.engine_peak(shape, inp, hbm).as_dict()
    per_token = shape.kv_bytes_per_token(memory.DTYPE_BYTES[inp.engine_dtype]) / inp.tensor_parallel
    kv = memory.engine_kv_bytes(shape, inp, hbm)
    lines += ["", f"Rollout ({inp.engine}, {inp.engine_dtype} weights, TP{inp.tensor_parallel}, "
              f"gpu_memory_utilization {inp.gpu_memory_utilization}):", "",
              "| weights | reserve | KV cache | KV tokens | sync staging (2 buckets) | context + comms | peak |",
              "|---|---|---|---|---|---|---|",
              f"| {_gbs(e['weights'])} | {_gbs(e.get('reserve', e.get('logits', 0.0)))} | {_gbs(kv)} | "
              f"{max(kv, 0.0) / per_token:,.0f} | {_gbs(e['sync_staging'])} | {_gbs(e['context_comms'])} | "
              f"{_gbs(sum(e.values()))} |",
              "", "Resize ops (peak per device at the split's trainer count):", "",
              "| trainers | leave training | reshard in | engine start | weight sync (trainer root) |",
              "|---|---|---|---|---|"]
    for w in sorted({s.train for s in fits}):
        ops = memory.op_peaks(shape, inp, hbm, w)
        lines.append(f"| {w} | " + " | ".join(_gbs(ops[k].total) for k in
                                              ("leave_training", "reshard_in", "engine_start", "weight_sync_trainer"))
                     + " |")
    lines += ["", "Splits:", "", "| rollout : train | train peak | rollout peak | fits | limit |", "|---|---|---|---|---|"]
    for s in fits:
        lines.append(f"| {s.rollout} : {s.train} | {_gbs(s.train_peak.total)} | {_gbs(s.rollout_peak.total)} | "
                     f"{'yes' if s.fits else 'no'} | {s.limit} |")
    lines += ["", "Estimates: " + "; ".join(assumptions()) + "."]
    return "\n".join(lines)
