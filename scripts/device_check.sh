#!/usr/bin/env bash
# The CUDA-path check for the GPU machine lent for checks: one command, offline, no venv and no
# pip. It uses that machine's own `python3` (a CUDA torch, transformers, safetensors, numpy; no
# Ray, no vLLM) with the project on PYTHONPATH, so the roles and the trainer must import without
# Ray (where this checkout has a .venv, its python; PYTHON=... picks another). Fails at once when
# torch sees no CUDA device. One line per check; exit status 1 when any
# check failed. Budget: under 8 minutes (4 for each Python part, the GPU tests within them). The whole output also goes to $OUT/device_check.txt
# when OUT is set.
#
# Checks (scripts/device_check.py): an FSDP2 bf16 training step on cuda:0 in a one-rank NCCL
# world with its state bytes; the HF engine generating on CUDA; weight sync trainer -> engine in
# one process with the digest checked; teardown and release freeing GPU memory
# (torch.cuda.mem_get_info); the export loading in transformers; the sync and generation times;
# then the data path at model scale (scripts/device_check_scale.py: vLLM's peer probe under
# CUDA_VISIBLE_DEVICES=0, a 7B's bf16 weight sync received with its device peak, a dropped
# trainer's bytes with the GC frozen, FSDP2 steps of a 1.5B on 4k tokens beside preflight's plan,
# the bytes of each NCCL group); then the GPU tests (tests/gpu) when pytest is there. What only a node with several GPUs shows
# (NCCL across devices, resizes on real workers) is listed in docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# The machine's python3 (the GPU machine has no venv); the project's .venv where one was made.
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
LOG="${OUT:-/tmp}/device_check.txt"
mkdir -p "$(dirname "$LOG")"
: > "$LOG.stderr"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

timeout 240 "$PY" scripts/device_check.py "$@" 2>>"$LOG.stderr" | tee "$LOG"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
  [ -s "$LOG.stderr" ] && tail -n 5 "$LOG.stderr" | sed 's/^/  stderr: /'
  exit 1
fi

# Each of our TP actors sees one GPU: the peer probe is checked the way such an actor meets it.
CUDA_VISIBLE_DEVICES=0 timeout 240 "$PY" scripts/device_check_scale.py 2>>"$LOG.stderr" | tee -a "$LOG"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  [ -s "$LOG.stderr" ] && tail -n 5 "$LOG.stderr" | sed 's/^/  stderr: /'
  exit 1
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  if timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu >>"$LOG.stderr" 2>&1 \
     && tail -n 1 "$LOG.stderr" | grep -Eq '[1-9][0-9]* passed' && ! tail -n 1 "$LOG.stderr" | grep -q skipped; then
    echo "gpu tests: ok ($(grep -Eo '[0-9]+ passed' "$LOG.stderr" | tail -1))" | tee -a "$LOG"
  else
    echo "gpu tests: FAILED ($(grep -Eo '[0-9]+ (passed|failed|skipped)' "$LOG.stderr" | tr '\n' ' '))" | tee -a "$LOG"
    exit 1
  fi
else
  echo "gpu tests: skipped (no pytest on this machine)" | tee -a "$LOG"
fi
