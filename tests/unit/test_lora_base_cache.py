"""A LoRA trainer rebuilt for a move reads its base from the process's kept `InitialWeights`
(roles/initial_weights.py `shared_initial_weights`), never building the model again:

- the built-in model is initialised once per process however many trainers are built (a
  start, then rebuilds with no initial model), and every row equals `build_model`'s;
- a model folder is opened once and read by slice (no build at all);
- the kept one records no reads (it would grow without bound), a one-off one still does.
"""

from __future__ import annotations

import os
import types

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cfg(path=None):
    from dynaresize.config import ModelConfig

    return ModelConfig(path=path, vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _spec(cfg):
    from dynaresize.config import LoraConfig

    return types.SimpleNamespace(model=cfg, lora=LoraConfig(rank=4, alpha=8.0), seed=1)


def _count_builds(monkeypatch) -> list[int]:
    import dynaresize.rl.models as models

    calls, real = [], models.build_model

    def counted(cfg):
        calls.append(1)
        return real(cfg)
    monkeypatch.setattr(models, "build_model", counted)
    return calls


def test_builtin_base_is_built_once_per_process_and_equals_the_model(monkeypatch):
    from dynaresize.rl.models import build_model
    from dynaresize.roles import lora_model
    from dynaresize.roles.initial_weights import initial_weights, shared_initial_weights

    cfg = _cfg()
    shared_initial_weights.cache_clear()
    want = {n: p.detach().clone() for n, p in build_model(cfg).named_parameters()}
    calls = _count_builds(monkeypatch)
    start = lora_model.trainer_rows(_spec(cfg), initial_weights(cfg))  # a trainer's start: builds (off a move)
    assert len(calls) == 1 and start.adapter is not None
    rebuilt = [lora_model.trainer_rows(_spec(cfg), None) for _ in range(3)]  # rebuilds for moves: no build
    assert len(calls) == 1
    assert all(r.base is start.base is shared_initial_weights(cfg) and r.adapter is None for r in rebuilt)
    for name, t in want.items():
        peft_name = f"{lora_model.PEFT_PREFIX}{name}"
        assert torch.equal(rebuilt[0].rows(peft_name, 1, 3), t[1:3]), name
    assert shared_initial_weights(cfg).rows_read == []  # the kept one does not record
    fresh = initial_weights(cfg)
    fresh.rows(next(iter(want)), 0, 1)
    assert fresh.rows_read == [(next(iter(want)), 0, 1)]
    shared_initial_weights.cache_clear()


def test_folder_base_is_read_by_slice_from_one_open_file(tmp_path, monkeypatch):
    from dynaresize.rl.models import build_model, build_tokenizer, save_hf
    from dynaresize.roles import lora_model
    from dynaresize.roles.initial_weights import shared_initial_weights

    model = build_model(_cfg())
    save_hf(model, build_tokenizer(300), tmp_path / "m")
    cfg = _cfg(str(tmp_path / "m"))
    shared_initial_weights.cache_clear()
    calls = _count_builds(monkeypatch)
    rows = [lora_model.trainer_rows(_spec(cfg), None) for _ in range(2)]
    base = rows[0].base
    assert rows[1].base is base and not base.whole
    for name, p in model.named_parameters():
        assert torch.equal(rows[1].rows(f"{lora_model.PEFT_PREFIX}{name}", 0, 2), p.detach()[:2]), name
    assert calls == [] and len(base._open) == 1  # nothing built, the one safetensors file opened once
    shared_initial_weights.cache_clear()
