#!/usr/bin/env bash
# Install torch into the venv of python $1 where none is installed, as `make setup` does:
# - with a GPU (nvidia-smi lists one): PyPI's `torch==$TORCH_VERSION`, the CUDA build;
# - without one, on Linux x86_64: the CPU build, `torch==$TORCH_VERSION+cpu` from PyTorch's CPU
#   index ($TORCH_INDEX, default https://download.pytorch.org/whl/cpu), so setup never pulls the
#   multi-GB CUDA build that a bare `torch` from PyPI is there; a local wheel where pip is
#   configured with one (find-links) serves too;
# - elsewhere (aarch64, macOS): PyPI's `torch==$TORCH_VERSION`, a CPU build there.
# TORCH_SPEC overrides the requirement whole (e.g. TORCH_SPEC='torch==2.14.1' TORCH_INDEX=...).
set -euo pipefail
PY="${1:?usage: install_torch.sh PYTHON}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

if "$PY" -c "import torch" >/dev/null 2>&1; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  spec="${TORCH_SPEC:-torch==$TORCH_VERSION}"
  echo "torch: a GPU is present: installing $spec (PyPI's CUDA build)"
  "$PY" -m pip install --quiet "$spec"
elif [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ]; then
  spec="${TORCH_SPEC:-torch==$TORCH_VERSION+cpu}"
  echo "torch: no GPU: installing $spec (the CPU build; index $TORCH_INDEX)"
  "$PY" -m pip install --quiet "$spec" --extra-index-url "$TORCH_INDEX"
else
  spec="${TORCH_SPEC:-torch==$TORCH_VERSION}"
  echo "torch: installing $spec (PyPI's build for $(uname -s) $(uname -m): CPU)"
  "$PY" -m pip install --quiet "$spec"
fi
