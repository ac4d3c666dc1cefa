"""The tiny model and tokenizer built in code, and the HF checkpoint round trip."""

from __future__ import annotations

import json

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.models import (BOS, COMMON_WORDS, CONSONANTS, EOS, PAD, build_model, build_tokenizer,
                                  encode_prompt, load_tokenizer, num_parameters, pseudo_words, save_hf)

SMALL = ModelConfig(vocab_size=1000, hidden_size=32, num_layers=2, num_heads=2, init_seed=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tokenizer_size_specials_and_roundtrip():
    for size in (270, 2048):
        tok = build_tokenizer(size)
        assert len(tok) == size
        assert (tok.pad_token, tok.eos_token, tok.bos_token) == (PAD, EOS, BOS)
    tok = build_tokenizer(2048)
    text = "write words starting with b : bako, Hello World! 42 é"
    ids = encode_prompt(tok, text)
    assert tok.unk_token_id not in ids and all(0 <= i < 2048 for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Vocabulary words are one token each (the hand-written merges reproduce them).
    vocab = tok.get_vocab()
    words = [w for w in pseudo_words() if "\u0120" + w in vocab]
    assert len(words) > 1000
    assert {len(encode_prompt(tok, " " + w)) for w in words + COMMON_WORDS} == {1}
    assert {len(encode_prompt(tok, w)) for w in COMMON_WORDS} == {1}
    # Every first letter gets the same share (round-robin fill), give or take the few pseudo-words
    # that common words already made ("give", "begi" of "begin").
    counts = [sum(w[0] == c for w in words) for c in CONSONANTS]
    assert max(counts) - min(counts) <= 2
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(50)


def test_build_model_bit_identical_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(SMALL)
    after = torch.rand(3)
    assert torch.equal(before, after)  # the init used a forked RNG
    b = build_model(SMALL)
    c = build_model(ModelConfig(vocab_size=1000, hidden_size=32, num_layers=2, num_heads=2, init_seed=4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(v.dtype == torch.float32 for v in sa.values())
    # Tied head (the default): state_dict names it twice, named_parameters once.
    assert set(sa) == {n for n, _ in a.named_parameters()} | {"lm_head.weight"}
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert a.config.vocab_size == 1000 and a.config.num_hidden_layers == 2


def test_default_model_size():
    model = build_model(ModelConfig())
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    assert 1_000_000 < num_parameters(model) < 2_000_000


def test_save_hf_loads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_model(SMALL)
    tok = build_tokenizer(SMALL.vocab_size)
    out = save_hf(model, tok, tmp_path / "ckpt")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    tok2 = AutoTokenizer.from_pretrained(out)
    assert len(tok2) == len(tok)
    for text in ("write words starting with b , for example bako :", " dezo Hello, World! 123 é ✓ <eos>",
                 tok.decode(list(range(0, SMALL.vocab_size, 3)))):
        assert encode_prompt(tok2, text) == encode_prompt(tok, text), text
    ids = encode_prompt(tok2, "write words starting with b :")
    gen = loaded.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                          pad_token_id=tok2.pad_token_id)
    assert gen.shape == (1, len(ids) + 5) or (gen.shape[1] > len(ids) and gen[0, -1] == tok2.eos_token_id)
    # The same directory also works as a ModelConfig.path for build_model / load_tokenizer.
    cfg = ModelConfig(path=str(out))
    again = build_model(cfg)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    assert encode_prompt(load_tokenizer(cfg), "b :") == encode_prompt(tok, "b :")
