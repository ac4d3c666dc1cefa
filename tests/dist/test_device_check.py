"""`scripts/device_check.sh`, the check run on the GPU machine, tested where no GPU is.

Its Python part runs every check on the CPU with gloo (`--cpu`): the same trainer, engine,
sync, export and timing code the GPU run executes. On a machine without CUDA the script itself
stops at once with one line saying so and exits non-zero.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}


def test_every_check_passes_on_the_cpu_with_gloo():
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "--cpu"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    checks = {line.split(":")[0]: line for line in lines}
    for name in ("fsdp", "engine", "sync", "export"):
        assert checks[name].startswith(f"{name}: ok"), checks
    assert "gloo world" in checks["fsdp"] and "digest read back from the engine equals the trainer's: True" \
        in checks["sync"]
    assert lines[-1] == "device check: all ok"


def test_the_scale_checks_run_on_the_cpu_on_tiny_shapes():
    """scripts/device_check_scale.py, the model-scale part: every check's code runs (gloo, tiny
    shapes); the GPU run measures what the CPU cannot (device peaks, group bytes)."""
    proc = subprocess.run([sys.executable, "scripts/device_check_scale.py", "--cpu"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    checks = {line.split(" (")[0]: line for line in lines}
    for name in ("peer: ok", "sync7b: ok", "release: ok", "step1.5b fp32 ckpt=off: ok", "step1.5b bf16 ckpt=on: ok"):
        assert name in checks, lines
    assert "disable_custom_all_reduce=True" in checks["peer: ok"]
    assert "parameter reachable False" in checks["release: ok"]
    assert lines[-1] == "scale check: all ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script runs its checks")
def test_without_cuda_the_script_says_so_in_one_line_and_fails(tmp_path):
    proc = subprocess.run(["bash", "scripts/device_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**ENV, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "no CUDA device" in proc.stdout
