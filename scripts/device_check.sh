#!/usr/bin/env bash
# The CUDA-path check for a GPU machine, in one command, offline, with the project's own
# environment (`make setup`; the machine's CUDA torch is kept when it has one). One line per
# check; the whole output also goes to $OUT/device_check.txt when OUT is set.
#
# Checks: the GPU tests (engine on cuda:0, FSDP2 trainer step, full-weight gather and memory
# freed on release, NCCL world), then, with 2 or more GPUs, a real run on `Cluster` with
# `DeviceWorker`s on NCCL: weight sync every step, a resize each way, a deterministic run with
# resizes against a static run (same tokens, final weights within 1e-6), and the sync and
# resize times from its records. Budget: under 8 minutes on one node.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp}/device_check.txt"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled DYNARESIZE_NO_VLLM="${DYNARESIZE_NO_VLLM:-1}"

make -s setup >/dev/null 2>>"$LOG" && say "setup: ok" || { say "setup: FAILED (see $LOG)"; exit 1; }
PY=.venv/bin/python
say "gpu: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")')"
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')

if timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu >>"$LOG" 2>&1; then
  say "gpu tests: ok ($(grep -Eo '[0-9]+ passed' "$LOG" | tail -1))"
else
  say "gpu tests: FAILED (see $LOG)"
fi

if [ "$NGPU" -lt 2 ]; then
  say "cluster checks: skipped (need 2 GPUs, this machine has $NGPU: NCCL cannot put two ranks on one GPU)"
  exit 0
fi

RUNS=$(mktemp -d)
N=$(( NGPU < 4 ? NGPU : 4 ))
SCHED="2:$((N-1)),4:1"
common=(--no-progress --devices "$N" --rollout-devices 1 --steps 6 --set cluster.backend=nccl
        --set rollout.max_new_tokens=24 --set rollout.prompts_per_step=4)
if timeout 200 .venv/bin/dynaresize run "${common[@]}" --deterministic --policy scripted --schedule "$SCHED" \
     --out "$RUNS/scripted" >>"$LOG" 2>&1 \
   && timeout 200 .venv/bin/dynaresize run "${common[@]}" --deterministic --policy static:1 \
     --out "$RUNS/static" >>"$LOG" 2>&1; then
  $PY - "$RUNS" <<'EOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
from safetensors.torch import load_file
runs = Path(sys.argv[1])
recs = {n: [json.loads(l) for l in (runs / n / "records.jsonl").read_text().splitlines()] for n in ("scripted", "static")}
s = json.loads((runs / "scripted" / "summary.json").read_text())
print(f"cluster run: ledger_ok={s['ledger_ok']} resizes to rollout {s['resizes_to_rollout']}, to train {s['resizes_to_train']}")
tok = {n: {r["sample_id"]: r["token_sha1"] for r in rs if r["kind"] == "sample"} for n, rs in recs.items()}
a, b = (load_file(str(runs / n / "checkpoint" / "model.safetensors")) for n in ("scripted", "static"))
worst = max(float((a[k] - b[k]).abs().max()) for k in a)
print(f"deterministic: same tokens {tok['scripted'] == tok['static']}, max weight diff {worst:.2e} (<= 1e-6: {worst <= 1e-6})")
syncs = [r["sync_s"] for r in recs["scripted"] if r["kind"] == "step" and r["sync_s"] > 0]
print(f"weight sync: median {sorted(syncs)[len(syncs) // 2]:.3f} s over {len(syncs)} steps")
for r in recs["scripted"]:
    if r["kind"] == "resize":
        print(f"resize to {r['to_role']}: critical {r['critical_s']:.3f} s, total {r['total_s']:.3f} s")
EOF
else
  say "cluster run: FAILED (see $LOG)"
fi
rm -rf "$RUNS"
