"""`model.path` checked before anything starts (rl/model_path.py at config time, rl/models.py's
`model_problem` for what needs transformers): each bad folder is one sentence naming what is
missing, a folder saved by the project's own `save_hf` passes, and `build_config` turns a bad
one into one `model.path=...` config error without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynaresize.config import ModelConfig
from dynaresize.config_load import build_config
from dynaresize.errors import ConfigError
from dynaresize.rl import model_path
from dynaresize.rl.model_path import cached_snapshot, model_path_problem

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A folder written by the project's own save path (save_hf of build_model and build_tokenizer)."""
    from dynaresize.rl.models import build_model, build_tokenizer, save_hf

    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=600)
    return save_hf(build_model(cfg), build_tokenizer(cfg.vocab_size), tmp_path_factory.mktemp("hf") / "model")


def _copy(saved: Path, tmp_path: Path, *drop: str) -> Path:
    out = tmp_path / "model"
    shutil.copytree(saved, out)
    for name in drop:
        (out / name).unlink(missing_ok=True)
    return out


def test_a_saved_folder_passes_every_check(saved):
    from dynaresize.rl.models import check_model, model_problem

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in saved.iterdir()}
    assert model_path_problem(str(saved)) is None
    assert model_problem(ModelConfig(path=str(saved))) is None
    check_model(ModelConfig(path=str(saved)))  # raises nothing
    assert build_config({"model": {"path": str(saved)}}).model.path == str(saved)
    assert model_problem(ModelConfig()) is None  # the built-in model has no folder


def test_missing_file_and_empty_paths(tmp_path):
    assert model_path_problem(str(tmp_path / "nope")) == "no such folder"
    assert model_path_problem("~/models/x") == "no such folder (a leading ~ is not expanded: give the full path)"
    (tmp_path / "weights.gguf").write_text("x")
    assert model_path_problem(str(tmp_path / "weights.gguf")).startswith("is a file, not a folder")
    (tmp_path / "empty").mkdir()
    assert model_path_problem(str(tmp_path / "empty")).startswith("the folder is empty")
    assert model_path_problem(" ").startswith("empty: give the model's folder")


def test_each_missing_part_is_named_alone(saved, tmp_path):
    no_config = _copy(saved, tmp_path / "a", "config.json")
    assert model_path_problem(str(no_config)) == "no config.json"
    no_weights = _copy(saved, tmp_path / "b", "model.safetensors")
    assert model_path_problem(str(no_weights)).startswith("no weights (none of model.safetensors, ")
    no_tok = _copy(saved, tmp_path / "c", *TOKENIZER_FILES)
    assert model_path_problem(str(no_tok)).startswith("no tokenizer (none of tokenizer.json, ")
    only_config = _copy(saved, tmp_path / "d", "model.safetensors", *TOKENIZER_FILES)
    problem = model_path_problem(str(only_config))
    assert problem.startswith("no weights") and "; no tokenizer" in problem and "\n" not in problem


def test_a_folder_saved_without_its_tokenizer_is_refused(tmp_path):
    from dynaresize.rl.models import build_model, save_hf

    folder = save_hf(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)), None,
                     tmp_path / "m")
    assert model_path_problem(str(folder)).startswith("no tokenizer")


def test_other_tokenizer_vocabularies_count(saved, tmp_path):
    folder = _copy(saved, tmp_path, *TOKENIZER_FILES)
    (folder / "spiece.model").write_bytes(b"\0")  # a sentencepiece vocabulary
    assert model_path_problem(str(folder)) is None


def test_a_bad_config_json_or_weight_index(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    (folder / "config.json").write_text("{not json")
    assert model_path_problem(str(folder)).startswith("config.json is unreadable (JSONDecodeError: ")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert model_path_problem(str(folder)).startswith("config.json names no model_type")
    shutil.copy(saved / "config.json", folder / "config.json")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert model_path_problem(str(folder)) == ("model.safetensors.index.json names 1 weight file(s) missing from "
                                               "the folder (first: model-00002-of-00002.safetensors)")


def test_an_architecture_transformers_has_no_causal_lm_for(saved, tmp_path):
    from transformers import ViTConfig

    from dynaresize.rl.models import check_model, model_problem

    folder = _copy(saved, tmp_path, "config.json")
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    assert model_path_problem(str(folder)) is None  # the files are all there: only transformers can tell
    problem = model_problem(ModelConfig(path=str(folder)))
    assert problem.startswith("model_type 'vit' (no architectures listed) is not a causal LM transformers ")
    with pytest.raises(ConfigError) as exc:
        check_model(ModelConfig(path=str(folder)))
    assert exc.value.errors == [f"model.path={str(folder)!r}: {problem}"]
    config = json.loads((saved / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    assert "cannot read its config.json (ValueError: " in model_problem(ModelConfig(path=str(folder)))


def test_a_hub_id_while_offline(saved, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problem = model_path_problem("dynaresize-tests/no-such-model")
    assert problem.startswith("no such folder, and as a Hugging Face hub id it is not in the local HF cache")
    monkeypatch.setattr(model_path, "cached_snapshot", lambda repo: saved if repo == "org/cached" else None)
    assert model_path_problem("org/cached") is None  # a cached snapshot loads offline: its files are checked
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert model_path_problem("dynaresize-tests/no-such-model") is None  # online: transformers downloads it
    assert model_path_problem("/abs/no/such") == "no such folder"  # never a hub id


def test_cached_snapshot_finds_the_main_snapshot(saved, tmp_path):
    pytest.importorskip("huggingface_hub")
    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    shutil.copytree(saved, repo / "snapshots" / "abc123")
    assert cached_snapshot("org/tiny", cache_dir=tmp_path) == repo / "snapshots" / "abc123"
    assert cached_snapshot("org/other", cache_dir=tmp_path) is None


def test_build_config_refuses_a_bad_path_in_one_line_without_torch(tmp_path):
    with pytest.raises(ConfigError) as exc:
        build_config({"model": {"path": str(tmp_path / "nope")}})
    assert exc.value.errors == [f"model.path={str(tmp_path / 'nope')!r}: no such folder"]
    code = ("import sys\nfrom dynaresize.config_load import build_config\nfrom dynaresize.errors import ConfigError\n"
            f"try:\n    build_config({{'model': {{'path': {str(tmp_path)!r}}}}})\nexcept ConfigError as e:\n"
            "    print(e.errors)\nprint('torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str([f"model.path={str(tmp_path)!r}: the folder is empty (an HF causal-LM "
                                            "folder holds config.json, weights and tokenizer files)"]),
                                       "False False"]


def test_moe_router_load_balancing_loss_is_refused_not_dropped(saved, tmp_path):
    """An MoE config.json asking for the router's auxiliary loss (output_router_logits with a
    positive router_aux_loss_coef) is one config error naming both; with the loss off it passes."""
    folder = _copy(saved, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True, "router_aux_loss_coef": 0.001}))
    problem = model_path_problem(str(folder))
    assert problem and "output_router_logits=true" in problem and "router_aux_loss_coef=0.001" in problem
    with pytest.raises(ConfigError) as err:
        build_config({"model": {"path": str(folder)}})
    assert len(err.value.errors) == 1 and err.value.errors[0].startswith(f"model.path={str(folder)!r}")
    (folder / "config.json").write_text(json.dumps({**cfg, "output_router_logits": False, "router_aux_loss_coef": 0.001}))
    assert model_path_problem(str(folder)) is None
    (folder / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True, "router_aux_loss_coef": 0.0}))
    assert model_path_problem(str(folder)) is None
