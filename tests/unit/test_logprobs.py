"""The loss's log-probs in chunks (`train.logprob_chunk_tokens`, rl/logprobs.py) equal the whole-
logits path: per-token log-probs and entropies, the loss and every gradient, within 1e-6 in fp32,
with temperature, KL, an entropy term, a multi-turn mask and an empty response; tied and untied
output heads; the head is restored after the call."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.grpo import TrainSample, micro_batch_loss, response_logprobs
from dynaresize.rl.logprobs import supports_chunking
from dynaresize.rl.models import build_model

CFG = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(seed=0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(5):
        prompt = [2] + [rng.randrange(4, CFG.vocab_size) for _ in range(rng.randint(2, 7))]
        n = 0 if i == 3 else rng.randint(1, 11)  # one empty response
        resp = [rng.randrange(4, CFG.vocab_size) for _ in range(n)]
        mask = tuple(rng.randint(0, 1) if j else 1 for j in range(n)) if i == 1 else ()  # a multi-turn sample
        out.append(TrainSample((1, i, 0), prompt, resp, [-rng.uniform(1, 6) for _ in resp], rng.uniform(-1, 1),
                               loss_mask=mask))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_equal_the_whole_logits(tied):
    model = build_model(replace(CFG, tie_word_embeddings=tied))
    batch = _batch()
    with torch.no_grad():
        e_whole, e_chunk = [], []
        whole = response_logprobs(model, batch, temperature=0.7, entropies=e_whole)
        chunked = response_logprobs(model, batch, temperature=0.7, entropies=e_chunk, chunk_tokens=4)
    assert [t.shape for t in whole] == [t.shape for t in chunked]
    for a, b in zip(whole + e_whole, chunked + e_chunk):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    assert "forward" not in vars(model.get_output_embeddings())  # the head's own forward again


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_loss_and_gradients_equal_the_whole_ones(chunk):
    model = build_model(CFG)
    batch = _batch(1)
    ref = [[lp - 0.1 for lp in s.rollout_logprobs] for s in batch]
    kw = dict(total_response_tokens=40, clip_eps=0.2, kl_coef=0.05, ref_logprobs=ref, temperature=0.9,
              entropy_coef=0.01)

    def loss_and_grads(chunk_tokens):
        model.zero_grad()
        stats: dict = {}
        loss = micro_batch_loss(model, batch, stats=stats, chunk_tokens=chunk_tokens, **kw)
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    l0, s0, g0 = loss_and_grads(0)
    l1, s1, g1 = loss_and_grads(chunk)
    assert torch.allclose(l0, l1, atol=1e-6, rtol=0)
    assert s0.keys() == s1.keys() and all(abs(s0[k] - s1[k]) <= 1e-5 * max(1.0, abs(s0[k])) for k in s0)
    assert any(g.abs().max() > 0 for g in g0.values())
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=0), (name, (g0[name] - g1[name]).abs().max())


def test_models_that_change_logits_after_the_head_keep_the_whole_path():
    model = build_model(CFG)
    assert supports_chunking(model)
    model.config.final_logit_softcapping = 30.0
    assert not supports_chunking(model)
