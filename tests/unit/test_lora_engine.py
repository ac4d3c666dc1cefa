"""`train.lora` on the HF engine and in the export (roles/rollout_hf.py, roles/lora_model.py):

- the engine sent an adapter (as a dict or a weight-sync stream) serves exactly peft's merged
  model (`merge_and_unload`), its digest is the adapter's, a half alone is refused;
- the export folder loads in transformers as the merged model, and its `adapter/` folder loads
  with peft onto the base to the same logits;
- the adapter's wire names and shapes (`adapter_specs`) and the step-0 adapter (`initial_adapter`:
  seeded, lora_B zero).
"""

from __future__ import annotations

import pytest
import torch

from dynaresize.config import LoraConfig, ModelConfig
from dynaresize.rl.models import build_model
from dynaresize.roles.lora_model import adapter_specs, initial_adapter, save_export, wire_name, wrap
from dynaresize.roles.rollout_hf import HFRolloutEngine
from dynaresize.roles.weight_sync import weights_digest

MODEL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=300, init_seed=3)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _trained_adapter(seed: int = 1) -> dict[str, torch.Tensor]:
    """The step-0 adapter with lora_B made non-zero (as training would)."""
    adapter = initial_adapter(adapter_specs(MODEL, LORA), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    return {n: (torch.randn(t.shape, generator=gen) * 0.05 if n.endswith("lora_B") else t) for n, t in adapter.items()}


def _peft_merged(adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = wrap(build_model(MODEL), LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (w := wire_name(name)) is not None:
                p.copy_(adapter[w])
    return model.merge_and_unload()


def test_adapter_specs_and_the_step0_adapter():
    specs = adapter_specs(MODEL, LORA)
    assert [n for n, _ in specs][:2] == ["model.layers.0.self_attn.q_proj.lora_A", "model.layers.0.self_attn.q_proj.lora_B"]
    assert len(specs) == 2 * 3 * MODEL.num_layers
    shapes = dict(specs)
    assert shapes["model.layers.1.mlp.down_proj.lora_A"] == (4, build_model(MODEL).config.intermediate_size)
    assert shapes["model.layers.1.mlp.down_proj.lora_B"] == (32, 4)
    a, b = initial_adapter(specs, 5), initial_adapter(specs, 5)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a[specs[0][0]], initial_adapter(specs, 6)[specs[0][0]])
    assert all(not t.any() for n, t in a.items() if n.endswith("lora_B"))
    assert all(t.abs().max() <= 1 / t.shape[1] ** 0.5 and t.any() for n, t in a.items() if n.endswith("lora_A"))


@pytest.mark.parametrize("as_stream", [False, True])
def test_engine_serves_the_merged_model_and_digests_the_adapter(as_stream):
    adapter = _trained_adapter()
    engine = HFRolloutEngine(MODEL, 1.0, batch_rows=4, lora=LORA)
    if as_stream:  # chunks of (name, tensor) pairs, as a weight sync delivers them
        items = list(adapter.items())
        engine.set_weights(iter([items[:5], items[5:]]), 3)
    else:
        engine.set_weights(adapter, 3)
    merged = dict(_peft_merged(adapter).named_parameters())
    served = dict(engine._model.named_parameters())
    assert served.keys() == merged.keys()
    for name in merged:
        assert torch.equal(served[name], merged[name]), name
    assert engine.weights_digest([n for n, _ in adapter_specs(MODEL, LORA)]) == weights_digest(adapter.items())
    assert engine.version == 3
    # a later sync merges from the kept base: no drift from the adapter applied before
    engine.set_weights(initial_adapter(adapter_specs(MODEL, LORA), 1), 4)
    base = dict(build_model(MODEL).named_parameters())
    assert all(torch.equal(p, base[n]) for n, p in engine._model.named_parameters())


def test_engine_refuses_half_an_adapter_and_base_weights():
    adapter = _trained_adapter()
    engine = HFRolloutEngine(MODEL, 1.0, batch_rows=4, lora=LORA)
    with pytest.raises(RuntimeError, match="one adapter half only"):
        engine.set_weights({n: t for n, t in adapter.items() if not n.endswith("q_proj.lora_B")}, 1)
    with pytest.raises(RuntimeError, match="not an adapter tensor"):
        engine.set_weights({"model.norm.weight": torch.ones(32)}, 1)


def test_export_writes_the_merged_model_and_the_peft_adapter(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    adapter = _trained_adapter()
    save_export(MODEL, LORA, adapter, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter_config.json").exists()  # transformers would load the folder as an adapter
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    merged = dict(_peft_merged(adapter).named_parameters())
    assert all(torch.equal(p, merged[n]) for n, p in loaded.named_parameters())
    with_adapter = peft.PeftModel.from_pretrained(build_model(MODEL), tmp_path / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 9, 100]])
    with torch.no_grad():
        want, got = loaded(input_ids=ids).logits, with_adapter(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5), (want - got).abs().max()
    assert not torch.allclose(want, build_model(MODEL)(input_ids=ids).logits, atol=1e-4)  # the adapter shows


def test_target_modules_that_match_nothing_name_the_field():
    from dynaresize.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        adapter_specs(MODEL, LoraConfig(rank=2, target_modules=("nothing_proj",)))
    assert str(info.value).startswith("train.lora.target_modules='nothing_proj': ") and "\n" not in str(info.value)


def test_a_run_with_such_targets_exits_2_in_one_line_and_writes_nothing(tmp_path, capsys):
    from dynaresize.cli import main

    out = tmp_path / "run"
    assert main(["run", "--no-progress", "--set", "train.lora.rank=2", "--set",
                 "train.lora.target_modules=nothing_proj", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynaresize: config error: train.lora.target_modules='nothing_proj': ") and "\n" not in err
    assert not out.exists()  # refused before the run folder (commands/run.py)


def test_fused_experts_are_refused_and_linear_targets_of_an_moe_model_are_not(tmp_path):
    import sys
    from pathlib import Path

    from dynaresize.errors import ConfigError

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _moe_model import write_moe_model

    folder = ModelConfig(path=str(write_moe_model(tmp_path / "moe")))
    with pytest.raises(ConfigError) as info:
        adapter_specs(folder, LoraConfig(rank=2))  # all-linear: peft also wraps the fused expert weights
    message = str(info.value)
    assert message.startswith("train.lora.target_modules='all-linear': peft adapts model.layers.0.mlp.experts")
    assert "fused experts" in message and "\n" not in message
    specs = adapter_specs(folder, LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))
    assert specs and all(".self_attn." in n for n, _ in specs)
