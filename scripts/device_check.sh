#!/usr/bin/env bash
# The CUDA-path check to run on a lent GPU machine (see the device tool): installs the project
# into a fresh venv with the machine's torch if it has one, prints the GPU, runs tests/gpu and
# a short bench. Output goes to stdout (and $OUT when set) for the issue note.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/python -c "import torch" 2>/dev/null || .venv-gpu/bin/pip install --quiet torch
.venv-gpu/bin/pip install --quiet -e '.[dev]'
.venv-gpu/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled .venv-gpu/bin/python -m pytest -q -m gpu tests/gpu 2>&1 | tee "${OUT:-/tmp}/gpu_tests.txt"
