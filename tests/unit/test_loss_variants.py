"""The loss variants verl and TRL users set (issue 21), each against its formula, computed here
by hand on small tensors: clip-higher (`clip_ratio_low`/`clip_ratio_high`), dual clip
(`clip_ratio_c`), the four `loss_agg_mode`s, the entropy bonus, Dr. GRPO and the sample std
of the advantage; and the worker's loss (`DeviceWorker._loss_fn`) independent of how a step's
micro-batches are cut and of whether it is trained whole or in streaming parts.

Token log-probs come from a tiny model; each sample's behaviour log-probs are set from them so
that every token's ratio is a number chosen here, and the expected losses are written out."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.config_load import build_config
from dynaresize.rl import grpo
from dynaresize.rl.grpo import (
    TrainSample,
    group_advantages,
    loss_denominator,
    micro_batch_loss,
    response_logprobs,
)
from dynaresize.rl.models import build_model

CFG = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2)
MODES = grpo.LOSS_AGG_MODES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG)


def _logp(model, s: TrainSample) -> list[float]:
    with torch.no_grad():
        return response_logprobs(model, [s])[0].double().tolist()


def _with_ratios(model, sid, response, ratios, advantage) -> TrainSample:
    """A sample whose token t has ratio exp(logp_t - old_t) = ratios[t] under `model`."""
    draft = TrainSample(sid, [2, 7, 9], list(response), [0.0] * len(response), advantage)
    old = [lp - math.log(r) for lp, r in zip(_logp(model, draft), ratios)]
    return TrainSample(sid, draft.prompt_ids, draft.response_ids, old, advantage)


# ---------------------------------------------------------------- advantages


def test_sample_std_population_std_and_dr_grpo():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.6, 1.6]
    sample = group_advantages(rewards, 4, std="sample")
    population = group_advantages(rewards, 4, std="population")
    plain = group_advantages(rewards, 4, norm_by_std=False)
    # group 0: mean 0.5, squared deviations 4 x 0.25; sample std sqrt(1/3), population std 0.5
    assert sample[:4] == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-6) * x for x in (1, -1, -1, 1)], rel=1e-12)
    assert population[:4] == pytest.approx([0.5 / (0.5 + 1e-6) * x for x in (1, -1, -1, 1)], rel=1e-12)
    # group 1: mean 0.7, deviations -0.5 -0.3 -0.1 0.9, squares sum 1.16
    dev = [-0.5, -0.3, -0.1, 0.9]
    assert plain[4:] == pytest.approx(dev, abs=1e-12) and plain[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert sample[4:] == pytest.approx([d / (math.sqrt(1.16 / 3) + 1e-6) for d in dev], rel=1e-12)
    assert population[4:] == pytest.approx([d / (math.sqrt(1.16 / 4) + 1e-6) for d in dev], rel=1e-12)
    # torch's std is the sample std (verl's compute_grpo_outcome_advantage; TRL's nanstd the same)
    t = torch.tensor(rewards, dtype=torch.float64).view(2, 4)
    want = ((t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-6)).flatten().tolist()
    assert sample == pytest.approx(want, rel=1e-12)
    assert population[0] / sample[0] == pytest.approx(math.sqrt(4 / 3), rel=1e-5)  # sample std x1.155 at G=4
    assert group_advantages([3.0, 3.0], 2, std="sample") == [0.0, 0.0]
    with pytest.raises(ValueError, match="undefined"):
        group_advantages([1.0, 2.0], 1, std="sample")
    assert group_advantages([1.0, 2.0], 1, norm_by_std=False) == [0.0, 0.0]
    with pytest.raises(ValueError):
        group_advantages(rewards, 4, std="biased")


# ---------------------------------------------------------------- clipping


RATIOS = [0.5, 0.9, 1.1, 1.5, 4.0]


@pytest.mark.parametrize("adv, low, high, c, want", [
    # A > 0: max(-A r, -A clip(r, 1 - low, 1 + high)); dual clip never applies
    (1.0, 0.2, 0.28, 0.0, [-0.5, -0.9, -1.1, -1.28, -1.28]),
    (1.0, 0.2, 0.28, 3.0, [-0.5, -0.9, -1.1, -1.28, -1.28]),
    (2.0, 0.2, 0.2, 0.0, [-1.0, -1.8, -2.2, -2.4, -2.4]),
    # A < 0: max(-A r, -A clip(r)) then, with c > 1, min(., -A c)
    (-1.0, 0.2, 0.28, 0.0, [0.8, 0.9, 1.1, 1.5, 4.0]),
    (-1.0, 0.2, 0.28, 3.0, [0.8, 0.9, 1.1, 1.5, 3.0]),
    (-2.0, 0.05, 0.28, 1.4, [1.9, 1.9, 2.2, 2.8, 2.8]),
])
def test_clip_higher_and_dual_clip_per_token(model, adv, low, high, c, want):
    s = _with_ratios(model, (0, 0, 0), [11, 12, 13, 14, 15], RATIOS, adv)
    stats: dict = {}
    loss = micro_batch_loss(model, [s], denominator=1, clip_eps=0.2, clip_ratio_low=low, clip_ratio_high=high,
                            clip_ratio_c=c, stats=stats)
    assert loss.item() == pytest.approx(sum(want), rel=1e-5)
    if c:
        capped = sum(1 for r in RATIOS if adv < 0 and -adv * max(r, 1 - low) > -adv * c)
        assert stats["dual_clipped_tokens"] == capped
    # unset low/high fall back to clip_eps
    if low == high:
        same = micro_batch_loss(model, [s], denominator=1, clip_eps=low, clip_ratio_c=c)
        assert same.item() == pytest.approx(loss.item(), rel=1e-7)


def test_dual_clip_gradient_is_zero_where_capped(model):
    capped = _with_ratios(model, (0, 0, 0), [20], [4.0], -1.0)
    free = _with_ratios(model, (0, 0, 0), [20], [2.0], -1.0)
    for s, nonzero in ((capped, False), (free, True)):
        model.zero_grad()
        micro_batch_loss(model, [s], denominator=1, clip_eps=0.2, clip_ratio_c=3.0).backward()
        norm = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
        assert (norm > 0) == nonzero
    with pytest.raises(ValueError):
        micro_batch_loss(model, [free], denominator=1, clip_eps=0.2, clip_ratio_c=1.0)


# ---------------------------------------------------------------- aggregation


def _on_policy_pair(model):
    """Two samples of 2 and 4 tokens, ratio 1: token losses -A = -1 (x2) and +0.25 (x4)."""
    a = _with_ratios(model, (0, 0, 0), [30, 31], [1.0] * 2, 1.0)
    b = _with_ratios(model, (0, 0, 1), [40, 41, 42, 43], [1.0] * 4, -0.25)
    return [a, b]


# T = 6 tokens, N = 2 sequences, L = 8: sums -2 and 1, means -1 and 0.25
AGG_WANT = {"token-mean": (-2 + 1) / 6, "seq-mean-token-sum": (-2 + 1) / 2, "seq-mean-token-mean": (-1 + 0.25) / 2,
            "seq-mean-token-sum-norm": (-2 / 8 + 1 / 8) / 2}


@pytest.mark.parametrize("mode", MODES)
def test_loss_agg_modes(model, mode):
    pair = _on_policy_pair(model)
    denom = loss_denominator(mode, tokens=6, sequences=2)
    assert denom == (6 if mode == "token-mean" else 2)
    whole = micro_batch_loss(model, pair, denominator=denom, clip_eps=0.2, loss_agg_mode=mode,
                             max_response_tokens=8)
    assert whole.item() == pytest.approx(AGG_WANT[mode], abs=1e-6)
    parts = sum(micro_batch_loss(model, [s], denominator=denom, clip_eps=0.2, loss_agg_mode=mode,
                                 max_response_tokens=8).item() for s in pair)
    assert parts == pytest.approx(whole.item(), abs=1e-6)


def test_token_mean_is_todays_loss(model):
    pair = _on_policy_pair(model)
    old = micro_batch_loss(model, pair, total_response_tokens=6, clip_eps=0.2)
    new = micro_batch_loss(model, pair, denominator=6, clip_eps=0.2, loss_agg_mode="token-mean")
    assert old.item() == new.item()
    with pytest.raises(ValueError):
        micro_batch_loss(model, pair, clip_eps=0.2)
    with pytest.raises(ValueError):
        micro_batch_loss(model, pair, denominator=2, clip_eps=0.2, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        loss_denominator("seq-mean", tokens=6, sequences=2)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_bonus_is_aggregated_like_the_loss(model, mode):
    pair = _on_policy_pair(model)
    ents: list = []
    with torch.no_grad():
        response_logprobs(model, pair, entropies=ents)
    h = [e.double().tolist() for e in ents]
    agg = {"token-mean": sum(map(sum, h)) / 6, "seq-mean-token-sum": sum(map(sum, h)) / 2,
           "seq-mean-token-mean": (sum(h[0]) / 2 + sum(h[1]) / 4) / 2,
           "seq-mean-token-sum-norm": (sum(h[0]) / 8 + sum(h[1]) / 8) / 2}[mode]
    denom = loss_denominator(mode, tokens=6, sequences=2)
    kw = {"denominator": denom, "clip_eps": 0.2, "loss_agg_mode": mode, "max_response_tokens": 8}
    model.zero_grad()
    base = micro_batch_loss(model, pair, **kw)
    base.backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bonus = micro_batch_loss(model, pair, entropy_coef=0.1, **kw)
    bonus.backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    assert bonus.item() - base.item() == pytest.approx(-0.1 * agg, rel=1e-5)
    # the gradient difference is -0.1 x the gradient of the aggregated entropy
    model.zero_grad()
    ents = []
    response_logprobs(model, pair, entropies=ents, entropy_grad=True)
    weights = {"token-mean": [1 / 6, 1 / 6], "seq-mean-token-sum": [1 / 2, 1 / 2],
               "seq-mean-token-mean": [1 / 4, 1 / 8], "seq-mean-token-sum-norm": [1 / 16, 1 / 16]}[mode]
    (weights[0] * ents[0].sum() + weights[1] * ents[1].sum()).backward()
    for a, b, p in zip(g1, g0, model.parameters()):
        assert torch.allclose(a - b, -0.1 * p.grad, atol=1e-6)


# ---------------------------------------------------------------- the worker's loss: W and cut invariant


def _worker(**train):
    from dynaresize.cluster.worker import DeviceWorker

    cfg = build_config({"rollout": {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 8},
                        "train": train})
    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None
    worker.cfg, worker.trainer = cfg, SimpleNamespace(ref=None)
    return worker


def _step(model):
    """One step of 2 prompts x 3 samples, 1..6 tokens each, ratios around 1."""
    out = []
    for i in range(6):
        n = i + 1
        ratios = [0.6 + 0.15 * ((i + t) % 6) for t in range(n)]
        out.append(_with_ratios(model, (0, i // 3, i % 3), [50 + 7 * i + t for t in range(n)], ratios,
                                [1.2, -0.4, -0.8, 0.9, 0.1, -1.0][i]))
    return out


KNOBS = {"clip_ratio_high": 0.28, "clip_ratio_c": 1.3, "entropy_coef": 0.01, "norm_adv_by_std": False}


@pytest.mark.parametrize("mode", MODES)
def test_worker_step_loss_does_not_depend_on_the_cut(model, mode):
    worker = _worker(loss_agg_mode=mode, **KNOBS)
    samples = _step(model)
    tokens = grpo.total_response_tokens(samples)
    results = []
    for mbs in (1, 2, 4, 6):
        mbs_list = grpo.micro_batches(samples, mbs)
        fn = worker._loss_fn(tokens)
        model.zero_grad()
        total = 0.0
        for mb in reversed(mbs_list):  # any order, any trainer
            loss, _ = fn(model, mb)
            loss.backward()
            total += loss.item()
        results.append((total, [p.grad.clone() for p in model.parameters()]))
        # streaming: unnormalised parts, the gradient scaled by 1 / denominator at the end
        part = worker._loss_fn(None)
        model.zero_grad()
        summed = 0.0
        for mb in mbs_list:
            loss, _ = part(model, mb)
            loss.backward()
            summed += loss.item()
        denom = worker._loss_denominator(tokens)
        assert summed / denom == pytest.approx(total, rel=1e-5, abs=1e-7)
        for g, p in zip(results[-1][1], model.parameters()):
            # dividing each part or the sum by the denominator: float32 rounding (~2 ulp of the sum-loss gradients)
            assert torch.allclose(p.grad / denom, g, atol=3e-7)
    first_total, first_grads = results[0]
    for total, grads in results[1:]:
        assert total == pytest.approx(first_total, rel=1e-5, abs=1e-7)
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads, first_grads))
    # the step's loss by hand: per-sample sums of the clipped per-token loss, entropy aside
    want_tokens = []
    for s in samples:
        lp = _logp(model, s)
        row = []
        for t, old in enumerate(s.rollout_logprobs):
            r, a = math.exp(lp[t] - old), s.advantage
            pg = max(-a * r, -a * min(max(r, 0.8), 1.28))
            row.append(min(pg, -a * 1.3) if a < 0 else pg)
        want_tokens.append(row)
    ents: list = []
    with torch.no_grad():
        response_logprobs(model, samples, entropies=ents)
    rows = [[v - 0.01 * h for v, h in zip(row, e.tolist())] for row, e in zip(want_tokens, ents)]
    want = {"token-mean": sum(map(sum, rows)) / tokens, "seq-mean-token-sum": sum(map(sum, rows)) / 6,
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / 6,
            "seq-mean-token-sum-norm": sum(sum(r) / 8 for r in rows) / 6}[mode]
    assert first_total == pytest.approx(want, rel=1e-5)


def test_worker_refuses_a_step_of_another_size_in_seq_modes():
    worker = _worker(loss_agg_mode="seq-mean-token-mean")
    assert worker._loss_denominator(21, 2) == 6  # 6 sequences in micro-batches of 4
    with pytest.raises(ValueError, match="sequences"):
        worker._loss_denominator(21, 3)
    assert _worker()._loss_denominator(21, 3) == 21  # token-mean: the step's tokens, whatever its size
