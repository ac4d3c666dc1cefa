"""`dynaresize run --preset user --set model.path=...` as a new user types it, on a folder that
cannot be loaded: a missing folder, an empty one, one saved without its tokenizer, a hub id
while the hub is off. Each is exit 2 with one line on stderr naming the path and what is
missing, no traceback, and nothing written (no run directory, nothing in the working folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run(tmp_path: Path, model_path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "dynaresize", "run", "--preset", "user", "--set",
                           f"model.path={model_path}", "--out", str(tmp_path / "work" / "run")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path / "work")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from dynaresize.config import ModelConfig
    from dynaresize.rl.models import build_model, save_hf

    root = tmp_path_factory.mktemp("models")
    (root / "empty").mkdir()
    save_hf(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)), None,
            root / "no-tokenizer")  # the model alone: config.json and model.safetensors
    return {"missing": root / "no" / "such" / "dir", "empty": root / "empty", "no-tokenizer": root / "no-tokenizer",
            "hub-id": Path("dynaresize-tests/not-cached")}


@pytest.mark.parametrize("case, says", [
    ("missing", "no such folder"),
    ("empty", "the folder is empty"),
    ("no-tokenizer", "no tokenizer (none of tokenizer.json"),
    ("hub-id", "as a Hugging Face hub id it is not in the local HF cache while the hub is off (HF_HUB_OFFLINE=1)"),
])
def test_a_model_path_that_cannot_load_is_one_line_and_exit_2(folders, tmp_path, case, says):
    (tmp_path / "work").mkdir()
    proc = _run(tmp_path, str(folders[case]))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dynaresize: config error: model.path={str(folders[case])!r}: ") and says in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "work" / "run").exists()
    assert list((tmp_path / "work").iterdir()) == []  # nothing written beside it either
