# The two commands a new user needs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup browser demo lint test test-slow test-faults bench clean

setup: $(STAMP)

# torch first where none is present (scripts/install_torch.sh: the CPU build from PyTorch's CPU
# index without a GPU, TORCH_INDEX / TORCH_SPEC to change it; the CUDA build with one): a bare
# `torch` requirement would otherwise pull a multi-GB CUDA build. Then vLLM
# (scripts/install_vllm.sh: the CPU build without nvidia-smi, the CUDA build with it;
# DYNARESIZE_NO_VLLM=1 skips it; where it cannot be installed a note is printed and the HF engine
# is used, except under CI=true or DYNARESIZE_REQUIRE_VLLM=1, where setup fails).
$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_vllm.sh
	$(PYTHON) -m venv $(VENV)
	scripts/install_torch.sh $(PY)
	$(PY) -m pip install --quiet -e '.[dev,cluster,tensorboard,mlflow,wandb]'
	scripts/install_vllm.sh $(PY)
	touch $(STAMP)

# Headless Chromium for the tests that open `dynaresize report`'s page (tests/e2e/test_report.py).
# Installed from Debian where it is missing and we are root; elsewhere those tests skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
	  echo "note: could not install chromium; the report browser test will be skipped"

demo: $(STAMP)
	$(VENV)/bin/dynaresize run --preset demo --out runs/demo

# The layer contracts (pyproject.toml [tool.importlinter], docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/lint-imports

# The layer contracts first, then the suite.
test: $(STAMP) browser
	$(VENV)/bin/lint-imports
	HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled $(PY) -m pytest -q
	@echo "make test: the default suite passed; the slow suite (fault matrix, resumes, node loss, TP replicas," \
	  "multi-turn, compare, bench resize, the demo and math presets) runs with 'make test-slow' (CI runs both)"

# Every slow test: the fault matrix and the rest of test-faults below, TP replicas, multi-turn and
# agent runs, compare, bench resize, the demo and math presets. CI runs it after `make test`.
test-slow: $(STAMP) browser
	HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled $(PY) -m pytest -q -m slow

# A subset of test-slow: the fault matrix (kill/stop x every fault point), the resumes on other device counts, a
# node lost whole on a 2-node Ray cluster on this machine (tests/e2e/test_multinode.py), and
# `ray start --head` + `ray job submit` (tests/e2e/test_job_submit.py).
test-faults: $(STAMP)
	HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled $(PY) -m pytest -q -m slow tests/e2e/test_faults.py tests/e2e/test_resume.py \
	  tests/e2e/test_multinode.py tests/e2e/test_job_submit.py

bench: $(STAMP)
	$(VENV)/bin/dynaresize bench sim --out bench-out/sim
	$(VENV)/bin/dynaresize bench resize --out bench-out/resize
	$(VENV)/bin/dynaresize bench rollout --out bench-out/rollout
	$(VENV)/bin/dynaresize bench checkpoint --out bench-out/checkpoint
	$(VENV)/bin/dynaresize bench sync --out bench-out/sync

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache
