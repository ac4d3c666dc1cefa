"""roles/lora.py: the adapter's wire names and the engine-side merge equal peft's merge."""

from __future__ import annotations

import pytest
import torch

from dynaresize.roles.lora import AdapterMerge, adapter_name, lora_scale, merged_weight, parse_adapter_name


def test_names_round_trip_and_refuse_what_is_not_an_adapter():
    assert parse_adapter_name(adapter_name("model.layers.0.self_attn.q_proj", "lora_B")) == (
        "model.layers.0.self_attn.q_proj", "lora_B")
    assert parse_adapter_name("model.layers.0.self_attn.q_proj.weight") is None
    with pytest.raises(ValueError, match="lora_C"):
        adapter_name("m", "lora_C")
    with pytest.raises(ValueError, match="rank"):
        lora_scale(0, 16)


def test_merge_waits_for_both_halves_reads_the_base_once_and_never_changes_it():
    torch.manual_seed(0)
    base, a, b = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2)
    reads = []
    merge = AdapterMerge(rank=2, alpha=4.0, dtype=torch.float32, read_base=lambda n: reads.append(n) or base)
    assert list(merge.feed([("m.lora_A", a)])) == [] and merge.pending() == ["m"]
    [(name, w)] = merge.feed([("m.lora_B", b)])
    assert name == "m.weight" and merge.pending() == []
    assert torch.allclose(w, base + 2.0 * b @ a)
    [(_, w2)] = merge.feed([("m.lora_A", a), ("m.lora_B", torch.zeros_like(b))])
    assert torch.equal(w2, base) and reads == ["m.weight"]  # merged from the untouched base, read once
    with pytest.raises(RuntimeError, match="not an adapter"):
        list(merge.feed([("m.weight", base)]))
    with pytest.raises(ValueError, match="do not fit"):
        merged_weight(base, a.T, b, 1.0, torch.float32)


def test_merge_equals_peft_merge_and_unload():
    import peft
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5, bias=False))
    base = model[0].weight.detach().clone()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=3, lora_alpha=6, target_modules=["0"], init_lora_weights=False))
    named = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" in n}
    a = next(v for n, v in named.items() if "lora_A" in n)
    b = next(v for n, v in named.items() if "lora_B" in n)
    ours = merged_weight(base, a, b, lora_scale(3, 6), torch.float32)
    theirs = lora.merge_and_unload()[0].weight.detach()
    assert torch.allclose(ours, theirs, atol=1e-6)
