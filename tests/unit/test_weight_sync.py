from __future__ import annotations

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model, complete_state_dict, tied_aliases
from dynaresize.roles.weight_sync import buckets, flatten, unflatten


def test_buckets_keep_order_and_bound():
    specs = [("a", (4, 4)), ("b", (100,)), ("c", (3,)), ("d", (2, 2))]
    out = buckets(specs, bucket_bytes=80)
    assert [s for b in out for s in b] == specs
    assert all(sum(4 * torch.Size(s).numel() for _, s in b) <= 80 or len(b) == 1 for b in out)
    assert [len(b) for b in out] == [1, 1, 2]


def test_flatten_round_trip_and_tied_aliases():
    model = build_model(ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300))
    named = dict(model.named_parameters())
    assert "lm_head.weight" not in named  # tied: one parameter
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    specs = [(n, tuple(p.shape)) for n, p in named.items()]
    state = unflatten(flatten(dict(named), specs).clone(), specs)
    assert all(torch.equal(state[n], p) for n, p in named.items())
    full = complete_state_dict(state, model)
    assert full["lm_head.weight"] is state["model.embed_tokens.weight"]
    model.load_state_dict(full, strict=True)
    with pytest.raises(ValueError, match="flat weights"):
        unflatten(torch.zeros(5), specs)
