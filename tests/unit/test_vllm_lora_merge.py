"""roles/vllm_lora.py without vLLM: a sync's adapter becomes whole vLLM modules of merged
weights (the untargeted parts of a packed module from the folder's base), a module once its
halves all arrived, streamed as the chunks arrive; a second adapter replaces the first; the
digest is the adapter's. The real engine: tests/dist/test_vllm_lora.py."""

from __future__ import annotations

import pytest
import torch

from dynaresize.errors import UserError
from dynaresize.roles.lora import merged_weight
from dynaresize.roles.vllm_lora import EngineLora, engine_group, is_adapter
from dynaresize.roles.weight_sync import weights_digest

P = "model.layers.0."
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
SHAPES = {f"{P}self_attn.{m}.weight": (o, 8) for m, o in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
SHAPES |= {f"{P}self_attn.{m}.bias": (o,) for m, o in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
SHAPES |= {f"{P}self_attn.o_proj.weight": (8, 8), f"{P}mlp.gate_proj.weight": (16, 8),
           f"{P}mlp.up_proj.weight": (16, 8), f"{P}mlp.down_proj.weight": (8, 16)}
QKV = tuple(f"{P}self_attn.{m}.{p}" for m in ("q_proj", "k_proj", "v_proj") for p in ("weight", "bias"))


@pytest.fixture()
def folder():
    """(a base reader that counts its reads, the base)"""
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    reads: list[str] = []

    def read(name):
        reads.append(name)
        return base[name].clone()  # KeyError for a name the policy lacks
    read.reads = reads
    return read, base


def adapter(module: str, seed: int, r: int = 2) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out, inn = SHAPES[f"{module}.weight"]
    return [(f"{module}.lora_A", torch.randn(r, inn, generator=g)), (f"{module}.lora_B", torch.randn(out, r, generator=g))]


def lora(read) -> EngineLora:
    return EngineLora(rank=2, alpha=4.0, dtype=torch.float32, read_base=read, shapes=SHAPES, packed=PACKED)


def test_engine_group_is_the_vllm_module_with_its_biases():
    assert engine_group(f"{P}self_attn.v_proj.weight", PACKED, SHAPES) == QKV
    assert engine_group(f"{P}mlp.up_proj.weight", PACKED, SHAPES) == (f"{P}mlp.gate_proj.weight", f"{P}mlp.up_proj.weight")
    assert engine_group(f"{P}mlp.down_proj.weight", PACKED, SHAPES) == (f"{P}mlp.down_proj.weight",)


def test_a_module_goes_whole_once_its_halves_arrived_and_streams_with_the_chunks(folder):
    path, base = folder
    q, v, gate = adapter(f"{P}self_attn.q_proj", 1), adapter(f"{P}self_attn.v_proj", 2), adapter(f"{P}mlp.gate_proj", 3)
    pulled: list[int] = []

    def chunks():
        for i, c in enumerate([q + v, gate[:1], gate[1:]]):
            pulled.append(i)
            yield list(c)

    eng = lora(path)
    got, seen_when = {}, {}
    for name, w in eng.merged_items(chunks()):
        got[name] = w
        seen_when[name] = len(pulled)
    assert list(got)[:6] == list(QKV) and all(seen_when[n] == 1 for n in QKV)  # before chunk 2 was asked for
    assert seen_when[f"{P}mlp.gate_proj.weight"] == 3  # its lora_B came in chunk 3
    assert set(got) == set(QKV) | {f"{P}mlp.gate_proj.weight", f"{P}mlp.up_proj.weight"}  # o, down untouched
    qn = f"{P}self_attn.q_proj.weight"
    assert torch.equal(got[qn], merged_weight(base[qn], q[0][1], q[1][1], 2.0, torch.float32))
    for untargeted in (f"{P}self_attn.k_proj.weight", f"{P}self_attn.q_proj.bias", f"{P}mlp.up_proj.weight"):
        assert torch.equal(got[untargeted], base[untargeted])
    assert eng.digest(None, torch.float32) == weights_digest(q + v + gate)


def test_a_second_adapter_replaces_the_first_merged_from_the_base(folder):
    path, base = folder
    qn = f"{P}self_attn.q_proj.weight"
    eng = lora(path)
    with pytest.raises(RuntimeError, match="no LoRA adapter applied"):
        eng.digest(None, torch.float32)
    dict(eng.merged_items([adapter(f"{P}self_attn.q_proj", 1) + adapter(f"{P}self_attn.v_proj", 2)]))
    second = adapter(f"{P}self_attn.q_proj", 7)
    got = dict(eng.merged_items([list(second)]))
    assert torch.equal(got[qn], merged_weight(base[qn], second[0][1], second[1][1], 2.0, torch.float32))
    # v was not in this sync: its part of the module is the last adapter's merge, not the base
    vn, v = f"{P}self_attn.v_proj.weight", adapter(f"{P}self_attn.v_proj", 2)
    assert torch.equal(got[vn], merged_weight(base[vn], v[0][1], v[1][1], 2.0, torch.float32))
    zero = [(n, torch.zeros_like(t)) for n, t in second]
    assert torch.equal(dict(eng.merged_items([zero]))[qn], base[qn])  # nothing accumulated
    assert sorted(path.reads) == sorted(set(path.reads))  # each base weight read once over the syncs


def test_refusals(folder):
    path, _ = folder
    eng = lora(path)
    bad = [("model.layers.0.self_attn.rotary.lora_A", torch.zeros(2, 8)), ("model.layers.0.self_attn.rotary.lora_B",
                                                                          torch.zeros(8, 2))]
    with pytest.raises(KeyError, match="rotary"):  # not a weight of the policy
        list(eng.merged_items([bad]))
    with pytest.raises(RuntimeError, match="half an adapter"):
        list(lora(path).merged_items([adapter(f"{P}self_attn.o_proj", 1)[:1]]))
    wrong = [(f"{P}self_attn.o_proj.lora_A", torch.zeros(2, 4)), (f"{P}self_attn.o_proj.lora_B", torch.zeros(8, 2))]
    with pytest.raises(ValueError, match="do not fit"):  # the adapter does not fit the folder's base
        list(lora(path).merged_items([wrong]))
    wrong = [(f"{P}self_attn.o_proj.lora_A", torch.zeros(2, 8)), (f"{P}self_attn.o_proj.lora_B", torch.zeros(8, 2))]
    eng2 = EngineLora(rank=2, alpha=4.0, dtype=torch.float32, read_base=path, packed=PACKED,
                      shapes={**SHAPES, f"{P}self_attn.o_proj.weight": (8, 4)})
    with pytest.raises(UserError, match=r"o_proj.weight of shape \(8, 8\)"):  # nor the engine's weight
        list(eng2.merged_items([wrong]))
    eng3 = EngineLora(rank=2, alpha=4.0, dtype=torch.float32, read_base=path, packed=PACKED,
                      shapes={n: s for n, s in SHAPES.items() if "o_proj" not in n})
    with pytest.raises(UserError, match="o_proj.weight"):
        list(eng3.merged_items([wrong]))
    twice = adapter(f"{P}self_attn.q_proj", 1)
    with pytest.raises(RuntimeError, match="twice"):
        list(lora(path).merged_items([list(twice), list(twice)]))


def test_is_adapter_looks_at_the_first_chunk_and_puts_it_back():
    a = [("m.lora_A", torch.ones(1)), ("m.lora_B", torch.ones(1))]
    flag, rest = is_adapter(iter([a, [("n.lora_A", torch.zeros(1))]]))
    assert flag and [n for c in rest for n, _ in c] == ["m.lora_A", "m.lora_B", "n.lora_A"]
    flag, rest = is_adapter({"m.weight": torch.ones(1)})
    assert not flag and list(rest) == ["m.weight"]
    with pytest.raises(RuntimeError, match="mixed"):
        is_adapter({"m.weight": torch.ones(1), "m.lora_A": torch.ones(1)})


def test_save_weights_writes_a_tied_weight_once_under_the_embeddings_name(tmp_path):
    from safetensors.torch import load_file

    from dynaresize.roles.vllm_lora import save_weights

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(5, 3)
            self.lm_head = torch.nn.Linear(3, 5, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    model = Tied()
    save_weights(model, str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert list(saved) == ["embed_tokens.weight"] and torch.equal(saved["embed_tokens.weight"], model.embed_tokens.weight)


def test_policy_shapes_are_the_trainers_names_on_meta():
    from dynaresize.config import ModelConfig
    from dynaresize.rl.models import build_model
    from dynaresize.roles.vllm_lora import policy_shapes

    got = policy_shapes(ModelConfig())
    want = {n: tuple(p.shape) for n, p in build_model(ModelConfig()).named_parameters()}
    assert {n: tuple(t.shape) for n, t in got.items()} == want and all(t.is_meta for t in got.values())
