"""`dynaresize run`: the real elastic GRPO job on Ray workers.

Config resolution, most specific last: preset -> `--config FILE` -> flags (`--devices`,
`--steps`, ...) -> repeated `--set section.field=value`. A bad config lists every error and
exits 2 without a traceback. With no arguments it runs the `default` preset (4 CPU devices at
this machine's own speed). Nothing is paced unless `--emulate`, `cluster.emulate` or a preset
that names it (`--preset demo`, what `make demo` runs) says so.

`--resume RUN_DIR` continues the run in RUN_DIR from its last checkpoint: the saved config,
then `--steps`, `--devices`, `--rollout-devices`, `--policy`, `--schedule`, `--inject`, `--set`
on top (`--seed` and `--config` are refused: they define another job; faults of the
first run are not carried over). The checkpoint is verified before anything is written; a bad
one is one line and exit 1. A run that stops cleanly (a reward function failed, too few
devices left after a loss) leaves a consistent checkpoint and exits 1 with one line.

An injected fault (`--inject`) that never fired by the end of the run is a warning on stderr
(and `faults_unfired` in the summary): a fault test whose fault did not happen is no test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynaresize.config_load import apply_overrides, build_config, load_file, merge
from dynaresize.costmodel.costs import HARDWARE_PRESETS, MODEL_PRESETS
from dynaresize.emulate.model import UNPACED
from dynaresize.presets import PRESETS, preset


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run the elastic RL job (default: 4 CPU devices at this machine's speed; --preset demo: the "
        "emulated demo)",
        description="Run a disaggregated GRPO job (one-step-off by default; streaming with "
        "train.staleness >= 2) on Ray device workers whose rollout/train split follows the workload. "
        "With no arguments: local Ray, 4 CPU device workers at this machine's own speed, a tiny Qwen2 "
        "really generating and training on the toy task, the hysteresis policy, the demo length workload. "
        "Nothing is paced unless --emulate or cluster.emulate says so. --preset demo (what `make demo` runs): "
        "6 device workers paced as A100s running a 7B model, the demo-cap-raise length workload.",
        epilog="Flags left out keep the preset's (or the resumed run's) values; see docs/config.md.")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting config (default: default)")
    p.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override one field, e.g. --set policy.cooldown_steps=3 (repeatable)")
    p.add_argument("--out", default="runs/latest", metavar="RUN_DIR", help="run directory to write (default: runs/latest)")
    p.add_argument("--devices", type=int, help="number of devices (cluster.devices)")
    p.add_argument("--steps", type=int, help="number of RL steps")
    p.add_argument("--rollout-devices", type=int, help="initial rollout pool size (cluster.rollout_devices)")
    p.add_argument("--policy", help="hysteresis | static | static:R | static-profiled | greedy | scripted")
    p.add_argument("--schedule", help="for --policy scripted: STEP:R,... (before STEP, R rollout devices)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="deterministic mode: same tokens and final parameters as a static run")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    add_emulation_flags(p)
    p.add_argument("--inject", dest="faults", action="append", default=[], metavar="KIND:DEVICE@POINT:STEP",
                   help="inject a fault: KIND kill|stop|node, POINT rollout|train|weight_sync|resize.reshard|"
                   "resize.switch, e.g. kill:1@train:3 (repeatable; docs/faults.md)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint "
                   "(with --steps K, --devices N, --rollout-devices R to change them)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def add_emulation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate", metavar="ACCEL:MODEL",
                   help="pace every device to an emulated accelerator running a model, e.g. h100:7b "
                   f"(accelerators {', '.join(HARDWARE_PRESETS)}; models {', '.join(MODEL_PRESETS)}); "
                   "`none`: unpaced (cluster.emulate)")
    p.add_argument("--time-scale", type=float, metavar="X",
                   help="emulated seconds per wall second of paced work (cluster.time_scale; default 20, also "
                   "when --emulate replaces a preset's emulation)")


def resolve_config(args: argparse.Namespace, base: dict | None = None):
    """The run's config; `base` (a resumed run's saved config) replaces preset and file."""
    return build_config(resolve_data(args, base))


def resolve_data(args: argparse.Namespace, base: dict | None = None) -> dict:
    """The run's config as a dict, before it is built and checked (`dynaresize preflight` reads it
    without the model folder's weight check)."""
    data = base if base is not None else preset(args.preset)
    if args.config and base is None:
        data = merge(data, load_file(args.config))
    flags: dict = {}
    if base is not None or getattr(args, "faults", None):
        flags["faults"] = list(getattr(args, "faults", None) or [])
    if args.devices is not None:
        flags.setdefault("cluster", {})["devices"] = args.devices
    if args.rollout_devices is not None:
        flags.setdefault("cluster", {})["rollout_devices"] = args.rollout_devices
    elif args.devices is not None:
        flags.setdefault("cluster", {})["rollout_devices"] = max(1, args.devices // 2)
    if args.address:
        flags.setdefault("cluster", {})["address"] = args.address
    if getattr(args, "emulate", None):  # a preset's time scale goes with its emulation: --emulate resets it
        unpaced = args.emulate.strip().lower() in UNPACED
        flags.setdefault("cluster", {}).update(emulate=None if unpaced else args.emulate, time_scale=None)
    if getattr(args, "time_scale", None) is not None:
        flags.setdefault("cluster", {})["time_scale"] = args.time_scale
    if args.steps is not None:
        flags["steps"] = args.steps
    if args.seed is not None:
        flags["seed"] = args.seed
    if args.deterministic:
        flags["deterministic"] = True
    if args.policy:
        flags.setdefault("policy", {})["name"] = args.policy
    if args.schedule:
        flags.setdefault("policy", {})["schedule"] = args.schedule
    data = merge(data, flags)
    return apply_overrides(data, args.overrides)


def _check_faults(cfg) -> None:
    from dynaresize.cluster.faults import parse_faults

    parse_faults(cfg.faults, cfg.cluster.devices)  # ConfigError (exit 2) naming each bad one


def main(args: argparse.Namespace) -> int:
    from dynaresize.errors import RewardError, UserError

    point = None
    if getattr(args, "resume", None):
        from dynaresize.driver.checkpointing import load_resume_point

        for flag in ("config", "seed"):
            if getattr(args, flag, None):
                raise UserError(f"--{flag} cannot be combined with --resume: the resumed run keeps its job")
        point = load_resume_point(args.resume)  # CheckpointError (exit 1) before anything is written
        cfg = resolve_config(args, base=point.config)
        if cfg.steps <= point.boundary:
            raise UserError(f"--steps {cfg.steps}: the checkpoint of {args.resume} is at step {point.boundary}; "
                            f"nothing left to run (give a larger --steps)")
        out = args.resume
    else:
        cfg = resolve_config(args)
        out = args.out
    _check_faults(cfg)
    from dynaresize.rl.models import check_model

    check_model(cfg.model)  # transformers reads the folder's config (exit 2, nothing written)
    if cfg.model.path is not None:
        from dynaresize.roles.engine_map import check_engine_map

        check_engine_map(cfg)  # vLLM: a module type its weight path cannot map (exit 2, nothing written)
    if cfg.train.lora is not None:
        from dynaresize.roles.lora_model import adapter_specs

        adapter_specs(cfg.model, cfg.train.lora)  # peft on the meta model: targets that match nothing (exit 2, nothing written)
    from dynaresize.commands.memory_plan import check_at_start

    cfg = check_at_start(cfg)  # CUDA: a starting split that does not fit is exit 2; bounds keep splits that fit
    if cfg.cluster.emulate:
        print(emulation_banner(cfg), flush=True)
    from dynaresize.driver.recovery import RunStopped  # torch and Ray: only once the config holds
    from dynaresize.driver.run import run_job

    try:
        summary = run_job(cfg, out, progress=not args.no_progress, resume=point)
    except (RunStopped, RewardError) as exc:
        saved = Path(out) / "summary.json"  # written by the stop (`stopped` says so), else an older run's
        stop_summary = json.loads(saved.read_text()) if saved.is_file() else {}
        warn_unfired(stop_summary if stop_summary.get("stopped") else {})
        print(f"dynaresize: run stopped: {exc}", file=sys.stderr)
        return 1
    print(run_closing_summary(cfg, summary, out))
    warn_unfired(summary)
    return 0 if summary["ledger_ok"] else 1


def warn_unfired(summary: dict) -> None:
    """One warning line on stderr per injected fault that never fired."""
    from dynaresize.config import parse_fault

    for text in summary.get("faults_unfired") or []:
        f = parse_fault(text)
        print(f"dynaresize: warning: injected fault {text} never fired: the run did not reach {f.point} "
              f"at step {f.step} with device {f.device} alive", file=sys.stderr)


def run_closing_summary(cfg, summary: dict, out: str) -> str:
    """The closing summary (driver/console.py), with the simulator's prediction for an emulated run."""
    from dynaresize.driver.console import closing_summary
    from dynaresize.metrics import NO_PREDICTION_UNPACED

    if not cfg.cluster.emulate:
        return closing_summary(summary, out, no_prediction=NO_PREDICTION_UNPACED)
    if summary.get("stopped"):
        return closing_summary(summary, out)
    from dynaresize.emulate.predict import best_static, headline_prediction

    return closing_summary(summary, out, prediction=headline_prediction(cfg), best_static=best_static(cfg))


def emulation_banner(cfg) -> str:
    from dynaresize.emulate.model import time_scale_of

    return (f"dynaresize: emulated timing: every device paces its real work to a {cfg.cluster.emulate} "
            f"(accelerator:model) at {time_scale_of(cfg.cluster):g} emulated seconds per wall second; times "
            f"below are emulated seconds. Unpaced (this machine's own speed): add --emulate none")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.Namespace()))
