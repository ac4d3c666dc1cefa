"""Emulated gain of streaming (train.staleness = ETA) over one-step-off on the real runtime, and
the simulator's prediction for the same job (emulate.predict: sim.engine for ETA = 1, sim.stream
as the runtime runs it for ETA >= 2), both on a fixed split (policy static). docs/pipeline.md, "On the real
runtime", has the numbers. Usage (RUN_DIR prefix /tmp/stale-w/emu-etaN):

    DEV=8 EXTRA='{"cluster":{"emulate":"h100:7b","time_scale":20},"rollout":{"length_workload":"longtail-drift"}}' \
        python scripts/staleness_gain.py STEPS ROLLOUT_DEVICES 1,2 [--sim-only]
"""
import json
import os
import sys
import time

import ray

from dynaresize.config_load import build_config, merge
from dynaresize.driver.run import run_job
from dynaresize.emulate.predict import predict
from dynaresize.presets import preset

os.makedirs("/tmp/stale-w", exist_ok=True)
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
ROLL = int(sys.argv[2]) if len(sys.argv) > 2 else 4
etas = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]

def cfg_of(eta):
    import os
    devices = int(os.environ.get("DEV", "6"))
    extra = json.loads(os.environ.get("EXTRA", "{}"))
    data = merge(preset("demo"), {"steps": STEPS, "cluster": {"rollout_devices": ROLL, "devices": devices},
                                     "policy": {"name": "static"}, "train": {"staleness": eta}})
    return build_config(merge(data, extra))

out = {}
for eta in etas:
    cfg = cfg_of(eta)
    pred = predict(cfg)  # eta >= 2: the streaming engine as the runtime runs it (emulate.predict)
    p_sps = pred.num_samples / pred.total_time_s
    out[eta] = {"pred_samples_per_s": p_sps, "pred_total_s": pred.total_time_s, "pred_idle": pred.idle_device_s / (pred.total_time_s * pred.num_devices)}
    print("eta", eta, "prediction", out[eta], flush=True)

if "--sim-only" in sys.argv:
    sys.exit(0)
ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
for eta in etas:
    t = time.time()
    s = run_job(cfg_of(eta), f"/tmp/stale-w/emu-eta{eta}", progress=False)
    out[eta].update({k: s[k] for k in ("samples_per_s", "total_time_s", "overhead_fraction", "overrun_steps", "ledger_ok", "max_staleness", "real_fraction_max")})
    out[eta]["wall_s"] = time.time() - t
    print("eta", eta, out[eta], flush=True)
ray.shutdown()
for eta in etas[1:]:
    print(f"gain eta{eta}/eta{etas[0]}: measured {out[eta]['samples_per_s']/out[etas[0]]['samples_per_s']:.3f}  predicted {out[eta]['pred_samples_per_s']/out[etas[0]]['pred_samples_per_s']:.3f}")
json.dump(out, open(f"/tmp/stale-w/emu_gain-{ROLL}.json", "w"), indent=1)
