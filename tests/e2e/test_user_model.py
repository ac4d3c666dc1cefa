"""A user's own HF folder (tied embeddings, GQA, bf16 weights, its own byte-level BPE tokenizer
and chat template) trains through resizes both ways and exports a folder that loads with
transformers, embeddings still tied; what the model cannot take is refused with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _user_model import write_user_model

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    return write_user_model(tmp_path_factory.mktemp("user-model") / "model")


def _run(args, tmp_path, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "dynaresize", "run", "--no-progress", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow  # ~26 s; CI runs the slow suite (the folder's refusals stay in the default suite)
def test_user_folder_trains_through_resizes_and_exports_tied(user_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    proc = _run(["--preset", "user", "--set", f"model.path={user_dir}", "--set", "task.chat_template=true",
                 "--set", "rollout.max_new_tokens=12", "--set", "rollout.max_prompt_tokens=48",
                 "--set", "rollout.prompts_per_step=4", "--devices", "3", "--rollout-devices", "1",
                 "--steps", "5", "--policy", "scripted", "--schedule", "2:2,4:1", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"] and summary["resizes_to_rollout"] == 1 and summary["resizes_to_train"] == 1
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads == 1
    init = AutoModelForCausalLM.from_pretrained(user_dir, dtype=torch.float32)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), init.parameters()))
    assert moved > 1e-4  # it trained
    tok = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert tok.chat_template and len(tok) == model.config.vocab_size


def test_prompts_use_the_folder_chat_template_and_are_truncated(user_dir):
    from dynaresize.config_load import build_config, merge
    from dynaresize.driver.job import Job
    from dynaresize.presets import preset

    def first_prompt(max_prompt_tokens=64):
        rollout = {"max_new_tokens": 16, "max_prompt_tokens": max_prompt_tokens}
        data = merge(preset("user"), {"model": {"path": str(user_dir)}, "task": {"chat_template": True},
                                      "rollout": rollout})
        job = Job(build_config(data))
        return job, job.requests(0)[0][0].prompt_ids

    job, full = first_prompt()
    assistant = job.tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert full[0] == job.tokenizer.convert_tokens_to_ids("<|user|>") and full[-1] == assistant
    _, cut = first_prompt(max_prompt_tokens=5)
    assert len(full) > 5 and cut == full[-5:]  # the end (the question, the assistant turn) is kept


def test_prompt_plus_response_beyond_positions_exits_2(user_dir, tmp_path):
    proc = _run(["--preset", "user", "--set", f"model.path={user_dir}", "--set", "rollout.max_new_tokens=200",
                 "--set", "rollout.max_prompt_tokens=100", "--out", str(tmp_path / "r")], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "max_position_embeddings (256)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "records.jsonl").exists()


def test_chat_template_refused_when_the_tokenizer_has_none(tmp_path):
    proc = _run(["--set", "task.chat_template=true", "--out", str(tmp_path / "r")], tmp_path, timeout=120)
    assert proc.returncode == 2 and "has no chat template" in proc.stderr and "Traceback" not in proc.stderr
