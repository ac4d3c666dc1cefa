"""Emulated gain of streaming (train.staleness = ETA) over one-step-off on the real runtime, and
the simulator's prediction for the same job (emulate.predict: sim.engine for ETA = 1, sim.stream
as the runtime runs it for ETA >= 2), both on a fixed split (policy static). docs/pipeline.md, "On the real
runtime", has the numbers. Usage (run directories OUT/emu-etaN, the figures in OUT/emu_gain-ROLLOUT.json;
without --out, a new temporary directory):

    DEV=8 EXTRA='{"cluster":{"emulate":"h200:7b","time_scale":20},"rollout":{"length_workload":"longtail-drift"}}' \
        python scripts/staleness_gain.py STEPS ROLLOUT_DEVICES 1,2,2p [--out DIR] [--sim-only]

An ETA written with a trailing `p` (2p) is that staleness with partial rollout (rollout.partial).
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ray

from dynaresize.config_load import build_config, merge
from dynaresize.driver.run import run_job
from dynaresize.emulate.predict import predict
from dynaresize.presets import preset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("steps", type=int, nargs="?", default=10)
parser.add_argument("rollout", type=int, nargs="?", default=4)
parser.add_argument("etas", nargs="?", default="1,2")
parser.add_argument("--out", default=None, help="directory for the runs and the figures (default: a new temporary one)")
parser.add_argument("--sim-only", action="store_true")
args = parser.parse_args()
STEPS, ROLL = args.steps, args.rollout
etas = args.etas.split(",")


def cfg_of(eta):
    devices = int(os.environ.get("DEV", "6"))
    extra = json.loads(os.environ.get("EXTRA", "{}"))
    data = merge(preset("demo"), {"steps": STEPS, "cluster": {"rollout_devices": ROLL, "devices": devices},
                                  "policy": {"name": "static"}, "train": {"staleness": int(eta.rstrip("p"))},
                                  "rollout": {"partial": eta.endswith("p")}})
    return build_config(merge(data, extra))


out = {}
for eta in etas:
    cfg = cfg_of(eta)
    pred = predict(cfg)  # eta >= 2: the streaming engine as the runtime runs it (emulate.predict)
    p_sps = pred.num_samples / pred.total_time_s
    out[eta] = {"pred_samples_per_s": p_sps, "pred_total_s": pred.total_time_s,
                "pred_idle": pred.idle_device_s / (pred.total_time_s * pred.num_devices)}
    print("eta", eta, "prediction", out[eta], flush=True)

if not args.sim_only:
    OUT = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dynaresize-stale-"))
    OUT.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        for eta in etas:
            t = time.time()
            s = run_job(cfg_of(eta), OUT / f"emu-eta{eta}", progress=False)
            out[eta].update({k: s[k] for k in ("samples_per_s", "total_time_s", "overhead_fraction", "overrun_steps",
                                               "ledger_ok", "max_staleness", "real_fraction_max")})
            out[eta]["wall_s"] = time.time() - t
            print("eta", eta, out[eta], flush=True)
    finally:
        ray.shutdown()
    for eta in etas[1:]:
        print(f"gain eta{eta}/eta{etas[0]}: measured {out[eta]['samples_per_s'] / out[etas[0]]['samples_per_s']:.3f}  "
              f"predicted {out[eta]['pred_samples_per_s'] / out[etas[0]]['pred_samples_per_s']:.3f}")
    figures = OUT / f"emu_gain-{ROLL}.json"
    figures.write_text(json.dumps(out, indent=1))
    print(f"wrote {figures}")
