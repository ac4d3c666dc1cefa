"""`dynaresize advise`: would moving devices pay on this job? From the logs it already has.

Reads per-step metrics (`advise_read`: a verl console log, a TensorBoard event directory, a W&B
history CSV, or a dynaresize run directory: shadow mode), fits the simulator's stage models to
the logged stage times (`advise.job`, `advise.calibrate`), and runs the logged split, every
static split, hysteresis and the oracle through the simulator (`advise.answer`). Prints a
report ending in a verdict line; `--json` prints the whole answer instead; `--out DIR` writes
DIR/advise.json and DIR/advise.png. See docs/advise.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dynaresize.errors import ConfigError, UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dynaresize.commands.advise_read import FORMATS
    from dynaresize.costmodel.costs import HARDWARE_PRESETS, MODEL_PRESETS

    p = sub.add_parser("advise", help="would moving devices pay on your job? read its logs and simulate",
                       description="Read a job's per-step logs (verl console log, TensorBoard events, W&B CSV, or a "
                                   "dynaresize run directory), fit the simulator's stage models to them, and compare "
                                   "the logged split with every static split, hysteresis and the oracle.")
    p.add_argument("--from", dest="source", required=True, metavar="PATH",
                   help="a verl console log, a TensorBoard event directory, a W&B history CSV, or a run directory")
    p.add_argument("--format", choices=FORMATS, default="auto", help="how to read PATH (default: by what it is)")
    p.add_argument("--devices", type=int, default=None, metavar="N", help="devices of the job (a run directory: its own)")
    p.add_argument("--rollout-devices", type=int, default=None, metavar="R",
                   help="of them, the rollout pool; R = N: a colocated run (stages one after the other on all devices)")
    p.add_argument("--prompts-per-step", type=int, default=None, metavar="P",
                   help="prompts per step (verl data.train_batch_size; read from a printed config when there)")
    p.add_argument("--samples-per-prompt", type=int, default=None, metavar="n",
                   help="samples per prompt (verl actor_rollout_ref.rollout.n)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                   help="the model preset the fit starts from (default 7b; a run paced by cluster.emulate: its own)")
    p.add_argument("--accelerator", choices=sorted(HARDWARE_PRESETS), default=None,
                   help="the accelerator every device is (default h100; a run paced by cluster.emulate: its own)")
    p.add_argument("--staleness", type=int, default=1, metavar="S",
                   help="the pipeline to advise on: 1 one-step-off (default), 0 serial; >= 2 is refused")
    p.add_argument("--switch-s", type=float, default=None, metavar="SECONDS",
                   help="a move's critical time each way (default: the resize cost model's for the model and "
                        "accelerator, docs/resize.md)")
    p.add_argument("--length-trace", metavar="FILE", default=None,
                   help="a JSONL length trace (one line per logged step) instead of lengths rebuilt from mean/max")
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    p.add_argument("--out", metavar="DIR", default=None, help="write DIR/advise.json and DIR/advise.png")
    p.set_defaults(func=main)


def _need(value, flag: str, why: str):
    if value is None:
        raise UserError(f"{flag} is needed: {why}")
    if value < 1:
        raise ConfigError([f"{flag.lstrip('-')}={value}: must be >= 1"])
    return value


def main(args: argparse.Namespace) -> int:
    from dynaresize.advise.answer import Job, advise
    from dynaresize.advise.job import prepare
    from dynaresize.advise.logs import missing
    from dynaresize.commands.advise_read import emulated_presets, read
    from dynaresize.config import PolicyConfig
    from dynaresize.costmodel.costs import get_hardware, get_model
    from dynaresize.costmodel.scenarios import Scenario
    from dynaresize.types import Bounds
    from dynaresize.workload.trace import load_trace

    run = read(args.source, args.format)
    lacking = missing(run)
    if lacking:
        found = ", ".join(f"{v}" for v in run.found.values()) or "none of the known keys"
        raise UserError(f"{run.source}: cannot advise: no key for {'; '.join(lacking)} (found: {found})")
    for flag, given, own in (("devices", args.devices, run.num_devices), ("rollout-devices", args.rollout_devices,
                                                                         run.rollout_devices)):
        if given is not None and own is not None and given != own:
            raise ConfigError([f"{flag}={given}: the run directory ran with {own}"])
    N = _need(args.devices or run.num_devices, "--devices", "the log does not say how many devices the job ran on")
    R = _need(args.rollout_devices or run.rollout_devices, "--rollout-devices",
              "the log does not say how many of them ran the rollout (R = N for a colocated run)")
    if R > N:
        raise ConfigError([f"rollout-devices={R}: more than devices={N}"])
    if (args.prompts_per_step is None) != (args.samples_per_prompt is None):
        raise UserError("--prompts-per-step and --samples-per-prompt go together (the batch is their product)")
    if args.prompts_per_step is not None:
        samples = _need(args.prompts_per_step, "--prompts-per-step", "") * _need(args.samples_per_prompt,
                                                                                "--samples-per-prompt", "")
    else:
        samples = _need(run.samples_per_step, "--prompts-per-step and --samples-per-prompt",
                        "the log prints no config with the batch (verl data.train_batch_size x rollout.n)")
    emulated = emulated_presets(Path(args.source)) if Path(args.source).is_dir() else None
    model = get_model(args.model or (emulated[1] if emulated else "7b"))
    hw = get_hardware(args.accelerator or (emulated[0] if emulated else "h100"))
    lengths = run.lengths
    if args.length_trace:
        trace = load_trace(args.length_trace)
        usable = [s for s in run.steps if s.len_mean]
        if len(trace) < len(usable):
            raise UserError(f"{args.length_trace}: {len(trace)} steps of lengths for {len(usable)} logged steps")
        lengths = [b.response_tokens for b in trace[:len(usable)]]
    prep = prepare(run, num_devices=N, rollout_devices=R, samples_per_step=samples, base=model, hw=hw,
                   lengths=lengths)
    cal_model = prep.calibration.model
    if run.num_devices is not None:  # a dynaresize run: the bounds it ran under, not a preset's memory floor
        policy = _run_policy_bounds(Path(args.source))
        bounds = Bounds(num_devices=N, min_rollout=policy.get("min_rollout", 1), min_train=policy.get("min_train", 1),
                        move_unit=policy.get("move_unit", 1))
    else:
        bounds = Scenario(name=run.source, num_devices=N, num_steps=1, model=cal_model, hardware=hw).bounds()
    job = Job(name=run.source, batches=prep.batches, num_devices=N, rollout_devices=R, model=cal_model, hardware=hw,
              bounds=bounds, staleness=args.staleness, switch_s=args.switch_s)
    ans = advise(job, PolicyConfig(), colocated_step_s=list(prep.colocated_step_s or []) or None)
    doc = _document(run, prep, ans, N, R, samples, model.name, hw.name)
    doc["lengths"]["source"] = ("the length trace " + args.length_trace if args.length_trace else
                                "exact (sample records)" if run.lengths is not None else
                                "rebuilt from mean/max/clip ratio")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "advise.json").write_text(json.dumps(doc, indent=2) + "\n")
        from dynaresize.commands.advise_figure import write_figure

        doc["figure"] = str(write_figure(prep, ans, R, N, out / "advise.png"))
    print(json.dumps(doc, indent=2) if args.json else format_report(doc))
    return 0


def _run_policy_bounds(path: Path) -> dict:
    with open(path / "records.jsonl", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("kind") == "config":
                return rec.get("config", {}).get("policy", {})
    return {}


def _document(run, prep, ans: dict, N: int, R: int, samples: int, model: str, accel: str) -> dict:
    cal = prep.calibration
    return {
        "source": run.source, "steps_read": len(run.steps), "steps_used": len(prep.steps),
        "steps_fitted": {"rollout": len(prep.rollout_steps), "train": len(prep.train_steps)},
        "keys_found": run.found, "notes": list(prep.notes),
        "job": {"devices": N, "rollout_devices": R, "colocated": R >= N, "samples_per_step": samples,
                "model_preset": model, "accelerator": accel, "pipeline": ans["pipeline"]},
        "lengths": {"source": "", **prep.drift},
        "calibration": cal.to_json(),
        "logged_split": {"rollout": R, "train": N - R if R < N else N,
                         "samples_per_s_logged": prep.logged_samples_per_s,
                         "samples_per_s_reproduced": ans["reproduced_steps"],
                         "samples_per_s_reproduced_with_prologue": ans["reproduced"]},
        "static": ans["static"], "best_static": ans["best_static"], "hysteresis": ans["hysteresis"],
        "oracle": ans["oracle"], "switch_cost_s": ans["switch_cost_s"],
        "gain_vs_logged": ans["gain_vs_logged"], "gain_vs_best_static": ans["gain_vs_best_static"],
        "best_static_gain_vs_logged": ans["best_static_gain_vs_logged"],
        "oracle_gain_vs_logged": ans["oracle_gain_vs_logged"], "verdict": ans["verdict"],
    }


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_report(doc: dict) -> str:
    j, cal, ls = doc["job"], doc["calibration"], doc["logged_split"]
    lines = [f"read {doc['steps_read']} steps from {doc['source']} ({doc['steps_used']} used); keys: "
             + ", ".join(f"{k} <- {v}" for k, v in doc["keys_found"].items()),
             f"job: {j['devices']} devices, " + ("colocated" if j["colocated"] else
                                                 f"{j['rollout_devices']} rollout / {j['devices'] - j['rollout_devices']}"
                                                 " train")
             + f", {j['samples_per_step']} samples per step; fit from preset {j['model_preset']} on {j['accelerator']}",
             f"lengths ({doc['lengths']['source']}): mean {_f(doc['lengths']['mean_first'], '.0f')} -> "
             f"{_f(doc['lengths']['mean_last'], '.0f')} tokens, max {_f(doc['lengths']['max_first'], '.0f')} -> "
             f"{_f(doc['lengths']['max_last'], '.0f')} (first vs last tenth of the run)",
             f"calibration: rollout error {cal['rollout_error']:.1%}, training error {cal['train_error']:.1%}; "
             f"decode_eff {cal['decode_eff']:.2f}, mfu_decode {cal['mfu_decode']:.2f}, mfu_train {cal['mfu_train']:.2f}, "
             f"fixed training {cal['train_fixed_s']:.2f} s, per-step rest {cal['other_s']:.2f} s; the longest "
             f"response alone is {cal['floor_fraction']:.0%} of the rollout time (more rollout devices cannot shorten it)",
             f"logged split: {_f(ls['samples_per_s_logged'])} samples/s logged, {_f(ls['samples_per_s_reproduced'])} "
             "reproduced",
             "static splits (rollout devices: samples/s): " + ", ".join(
                 f"{s['rollout']}: {s['samples_per_s']:.2f}" for s in doc["static"]),
             f"best static: {doc['best_static']['rollout']} rollout devices, {doc['best_static']['samples_per_s']:.2f} "
             f"samples/s; hysteresis: {doc['hysteresis']['samples_per_s']:.2f} samples/s, {doc['hysteresis']['moves']} "
             f"move(s); oracle: {doc['oracle']['samples_per_s']:.2f} samples/s",
             f"gain vs logged split: {_f(doc['gain_vs_logged'], '.3f')}x, vs best static: "
             f"{_f(doc['gain_vs_best_static'], '.3f')}x; a move costs "
             + ", ".join(f"{k.replace('_', ' ')} {_f(v)} s" for k, v in doc["switch_cost_s"].items())]
    lines += [f"note: {n}" for n in doc["notes"]]
    lines.append(f"verdict: {doc['verdict']}")
    return "\n".join(lines)
