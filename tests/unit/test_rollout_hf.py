"""The HF rollout engine: a sample's tokens depend on (weights, prompt, seed, forced_length) only."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from dynaresize.config import ModelConfig
from dynaresize.rl.grpo import TrainSample, response_logprobs
from dynaresize.rl.models import build_model
from dynaresize.rl.seeds import sample_seed
from dynaresize.roles.base import GenRequest, GenResult, RolloutEngine
from dynaresize.roles.rollout_hf import HFRolloutEngine

CFG = ModelConfig()
TINY_VOCAB = ModelConfig(vocab_size=8, hidden_size=32, num_layers=1, num_heads=2)  # EOS (id 1) is likely


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights():
    model = build_model(CFG)
    # Perturb away from the init so set_weights visibly matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def engine(weights):
    eng = HFRolloutEngine(CFG, temperature=1.0)
    eng.set_weights(weights, version=3)
    return eng


def _requests(step: int = 0) -> list[GenRequest]:
    prompts = [[2, 10, 11, 12, 13], [2, 40, 41], [2, 200, 300, 400, 500, 600, 700, 800, 900]]
    reqs = []
    for p, ids in enumerate(prompts):
        for s in range(6):
            forced = [None, 7, 1, 20, 0, None][s]
            reqs.append(GenRequest(sample_id=(step, p, s), prompt_ids=ids, max_new_tokens=12 + 3 * p,
                                   seed=sample_seed(5, step, p, s), forced_length=forced))
    return reqs


def _same(a: GenResult, b: GenResult) -> bool:
    return a.sample_id == b.sample_id and a.response_ids == b.response_ids and a.logprobs == b.logprobs


def test_engine_satisfies_protocol_and_results_pickle(engine):
    assert isinstance(engine, RolloutEngine)
    res = engine.generate(_requests()[:2])
    assert [r.sample_id for r in res] == [(0, 0, 0), (0, 0, 1)]
    assert pickle.loads(pickle.dumps(res)) == res
    assert pickle.loads(pickle.dumps(_requests())) == _requests()
    assert all(r.version == 3 for r in res)


def test_tokens_identical_alone_in_batch_and_on_another_engine(engine, weights):
    reqs = _requests()
    batch = engine.generate(reqs)
    # Alone: each request in a call of its own.
    for req, res in zip(reqs, batch):
        assert _same(engine.generate([req])[0], res), req.sample_id
    # A bigger batch (more than batch_rows rows, other prompts and seeds mixed in), reversed order.
    bigger = list(reversed(reqs + _requests(step=1) + _requests(step=2)))
    by_id = {r.sample_id: r for r in engine.generate(bigger)}
    assert all(_same(by_id[r.sample_id], r) for r in batch)
    # A second engine instance given the same weights.
    other = HFRolloutEngine(CFG, temperature=1.0)
    other.set_weights(weights, version=3)
    assert all(_same(a, b) for a, b in zip(other.generate(reqs[::2]), batch[::2]))
    # Different seeds give different tokens (the seed is really used).
    assert len({tuple(r.response_ids) for r in batch if r.sample_id[1] == 0 and len(r.response_ids) > 5}) > 1


def test_forced_lengths_exact_and_max_new_tokens_bound(engine):
    reqs = _requests()
    for req, res in zip(reqs, engine.generate(reqs)):
        if req.forced_length is not None:
            assert len(res.response_ids) == req.forced_length
        else:
            assert 1 <= len(res.response_ids) <= req.max_new_tokens
        assert len(res.logprobs) == len(res.response_ids)
        assert res.duration_s >= 0 and math.isfinite(res.duration_s)


def test_eos_stops_unless_forced():
    eng = HFRolloutEngine(TINY_VOCAB, temperature=1.0)
    eng.set_weights(build_model(TINY_VOCAB).state_dict(), version=0)
    eos = 1
    reqs = [GenRequest((0, 0, s), [2, 3, 4], 40, sample_seed(0, 0, 0, s), None) for s in range(12)]
    forced = [GenRequest((1, 0, s), [2, 3, 4], 40, sample_seed(0, 1, 0, s), 40) for s in range(12)]
    free = eng.generate(reqs)
    for r in free:
        assert eos not in r.response_ids[:-1]
        assert r.response_ids[-1] == eos or len(r.response_ids) == 40
    assert any(r.response_ids[-1] == eos for r in free) and len({len(r.response_ids) for r in free}) > 1
    # Forced length: EOS is ignored and the response runs to exactly the forced length.
    out = eng.generate(forced)
    assert all(len(r.response_ids) == 40 for r in out)
    assert any(eos in r.response_ids[:-1] for r in out)


def test_logprobs_match_teacher_forced_recomputation(engine, weights):
    for temperature in (1.0, 0.7):
        eng = HFRolloutEngine(CFG, temperature=temperature)
        eng.set_weights(weights, version=0)
        reqs = [r for r in _requests() if r.forced_length != 0]
        results = eng.generate(reqs)
        model = build_model(CFG)
        model.load_state_dict(weights)
        samples = [TrainSample(r.sample_id, q.prompt_ids, r.response_ids, r.logprobs, 0.0)
                   for q, r in zip(reqs, results)]
        with torch.no_grad():
            recomputed = response_logprobs(model, samples, temperature=temperature)
        for s, lp in zip(samples, recomputed):
            assert all(math.isfinite(x) and x <= 0 for x in s.rollout_logprobs)
            assert torch.allclose(lp, torch.tensor(s.rollout_logprobs), atol=1e-5, rtol=0), s.sample_id


def test_temperature_changes_sampling(weights):
    cold = HFRolloutEngine(CFG, temperature=0.05)
    cold.set_weights(weights, version=0)
    hot = HFRolloutEngine(CFG, temperature=1.0)
    hot.set_weights(weights, version=0)
    req = [GenRequest((0, 0, s), [2, 10, 11], 10, sample_seed(1, 0, 0, s), 10) for s in range(4)]
    cold_lp = [sum(r.logprobs) for r in cold.generate(req)]
    hot_lp = [sum(r.logprobs) for r in hot.generate(req)]
    # A near-greedy policy puts far more mass on its own samples.
    assert min(cold_lp) > max(hot_lp)


def test_release_frees_and_set_weights_reloads(weights):
    eng = HFRolloutEngine(CFG, 1.0)
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(_requests()[:1])
    eng.set_weights(weights, version=1)
    before = eng.generate(_requests()[:3])
    eng.release()
    assert not eng.loaded
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(_requests()[:1])
    eng.set_weights(weights, version=2)
    assert eng.loaded
    after = eng.generate(_requests()[:3])
    assert [r.response_ids for r in after] == [r.response_ids for r in before]
    assert {r.version for r in after} == {2}


def test_set_weights_changes_tokens_and_is_strict(weights):
    eng = HFRolloutEngine(CFG, temperature=1.0)
    eng.set_weights(weights, version=0)
    a = eng.generate(_requests()[:1])[0]
    eng.set_weights(build_model(CFG).state_dict(), version=1)  # the unperturbed init
    b = eng.generate(_requests()[:1])[0]
    assert a.logprobs != b.logprobs
    by_param = {n: weights[n] for n, _ in build_model(CFG).named_parameters()}
    assert "lm_head.weight" not in by_param  # tied: the alias is filled in by the engine
    eng.set_weights(by_param, version=2)
    assert eng.generate(_requests()[:1])[0].logprobs == a.logprobs
    partial = dict(by_param)
    partial.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        eng.set_weights(partial, version=3)


def test_bad_inputs():
    with pytest.raises(ValueError):
        HFRolloutEngine(CFG, temperature=0.0)
    with pytest.raises(ValueError):
        HFRolloutEngine(CFG, temperature=1.0, batch_rows=0)



def test_requests_enter_and_leave_between_iterations_with_the_tokens_they_get_alone(engine):
    """The engine driven request by request (`SteppingEngine`): a request added while others
    decode, in the same or another prompt length, gives bit for bit what it gives alone; an
    aborted request gives no result and leaves the others unchanged."""
    from dynaresize.roles.base import SteppingEngine

    assert isinstance(engine, SteppingEngine)
    reqs = _requests()
    alone = {r.sample_id: engine.generate([r])[0] for r in reqs}
    first, late = reqs[:6], reqs[6:]  # late: other prompt lengths, and one of the first length
    engine.add(first)
    got, steps = {}, 0
    while engine.has_unfinished():
        for res in engine.step():
            got[res.sample_id] = res
        steps += 1
        if steps == 3:  # mid-generation: admit the rest, stop one of the first
            engine.add(late)
            assert engine.abort([(0, 0, 0), (9, 9, 9)]) == [(0, 0, 0)]  # an unknown id is ignored
    assert (0, 0, 0) not in got and set(got) == {r.sample_id for r in reqs} - {(0, 0, 0)}
    assert all(_same(got[sid], alone[sid]) for sid in got)
    assert engine.step() == [] and not engine.has_unfinished()
