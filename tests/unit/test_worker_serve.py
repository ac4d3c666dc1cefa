"""Request-level serving on a worker (cluster/worker_serve.py) over the real HF engine: requests
start and finish across `serve` calls; a request moved off an engine (`abort_all`) comes back as
it was sent, or with its prefix under partial rollout, and continuing it elsewhere keeps the
prefix's tokens and log-probs; a weight change under running requests is refused without
partial rollout and marks each request's token versions with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dynaresize.cluster.worker_serve import ServeMixin, engine_request, whole_result
from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model
from dynaresize.rl.seeds import sample_seed
from dynaresize.roles.base import GenRequest, GenResult
from dynaresize.roles.rollout_hf import HFRolloutEngine

CFG = ModelConfig()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weights(seed: int) -> dict:
    model = build_model(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return {k: v.clone() for k, v in model.state_dict().items()}


class Server(ServeMixin):
    """The worker's serving methods over one real engine (the rest of the actor left out)."""

    def __init__(self, weights: dict, version: int, partial: bool) -> None:
        self.engine = HFRolloutEngine(CFG, temperature=1.0)
        self.engine.set_weights(weights, version)
        self.cfg = SimpleNamespace(rollout=SimpleNamespace(partial=partial))
        self.device = 0

    def _maybe_fault(self, point: str, step: int) -> None:
        pass

    def _pin_threads(self) -> None:
        pass

    def pull(self, weights: dict, version: int) -> None:  # as restore_rollout does
        self.engine.set_weights(weights, version)
        self._mark_version(version)


def _req(p: int, n: int = 20) -> GenRequest:
    return GenRequest(sample_id=(3, p, 0), prompt_ids=[2, 10 + p, 11, 12], max_new_tokens=n,
                      seed=sample_seed(1, 3, p, 0), forced_length=n)


def _until_done(server: Server, pending: set) -> dict:
    out = {}
    while pending - set(out):
        for r in server.serve((), 0.05)["results"]:
            out[r.sample_id] = r
    return out


@pytest.fixture(scope="module")
def w0():
    return _weights(1)


@pytest.fixture(scope="module")
def w1():
    return _weights(2)


def test_serve_returns_results_as_they_finish_and_counts_the_running(w0):
    s = Server(w0, 0, partial=False)
    first = s.serve([_req(0, 3), _req(1, 12)], 10.0)
    assert [r.sample_id for r in first["results"]] == [(3, 0, 0)] and first["running"] == 1
    rest = _until_done(s, {(3, 1, 0)})
    alone = Server(w0, 0, partial=False).engine.generate([_req(1, 12)])[0]
    assert rest[(3, 1, 0)].response_ids == alone.response_ids and rest[(3, 1, 0)].versions == ()


def test_moved_request_comes_back_as_sent_and_gives_the_same_tokens_elsewhere(w0):
    a, b = Server(w0, 0, partial=False), Server(w0, 0, partial=False)
    a.serve([_req(0)], 0.0)
    a.engine.step()  # some tokens made on `a`
    moved = a.serve((), 0.0, abort_all=True)["moved"]
    assert moved == [_req(0)] and a.serve((), 0.0)["running"] == 0
    b.serve(moved, 0.0)
    got = _until_done(b, {(3, 0, 0)})[(3, 0, 0)]
    assert got.response_ids == Server(w0, 0, partial=False).engine.generate([_req(0)])[0].response_ids


def test_weight_change_under_running_requests_needs_partial_rollout(w0, w1):
    s = Server(w0, 0, partial=False)
    s.serve([_req(0)], 0.0)
    with pytest.raises(RuntimeError, match="rollout.partial"):
        s.pull(w1, 1)


def test_partial_rollout_marks_versions_and_a_moved_request_keeps_its_prefix(w0, w1):
    s = Server(w0, 4, partial=True)
    s.serve([_req(0, 20)], 0.0)  # one iteration, then it answers
    for _ in range(4):
        s.engine.step()  # 5 tokens under version 4
    s.pull(w1, 5)
    for _ in range(3):
        s.engine.step()  # 3 more under version 5
    moved = s.serve((), 0.0, abort_all=True, keep=True)["moved"]
    (r,) = moved
    assert len(r.prefix_ids) == len(r.prefix_logprobs) == 8 and r.prefix_versions == ((4, 0), (5, 5))
    alone = Server(w0, 4, partial=False).engine.generate([_req(0, 20)])[0]
    assert list(r.prefix_ids[:5]) == alone.response_ids[:5]  # the tokens made before the pull
    assert list(r.prefix_logprobs[:5]) == alone.logprobs[:5]
    assert list(r.prefix_logprobs[5:]) != alone.logprobs[5:8]  # the newer weights made the next ones
    other = Server(w1, 6, partial=True)
    other.serve(moved, 0.0)
    res = _until_done(other, {(3, 0, 0)})[(3, 0, 0)]
    assert len(res.response_ids) == 20 and res.response_ids[:8] == list(r.prefix_ids)
    assert res.logprobs[:8] == list(r.prefix_logprobs) and res.version == 4 and res.version_max == 6
    assert res.versions == ((4, 0), (5, 5), (6, 8))


def test_engine_request_and_whole_result_put_the_prefix_around_the_engine():
    r = GenRequest(sample_id=(1, 0, 0), prompt_ids=[2, 3], max_new_tokens=10, seed=7, forced_length=6,
                   prefix_ids=(5, 6), prefix_logprobs=(-0.5, -0.25), prefix_versions=((0, 0),))
    e = engine_request(r)
    assert e.prompt_ids == [2, 3, 5, 6] and e.max_new_tokens == 8 and e.forced_length == 4
    assert e.seed != r.seed and not e.prefix_ids
    res = GenResult(sample_id=(1, 0, 0), response_ids=[7, 8, 9, 10], logprobs=[-1.0] * 4, version=1, duration_s=0.1)
    whole = whole_result(r, res, [(0, 0), (1, 2)])
    assert whole.response_ids == [5, 6, 7, 8, 9, 10] and whole.logprobs[:2] == [-0.5, -0.25]
    assert whole.version == 0 and whole.versions == ((0, 0), (1, 2))
    assert whole_result(r, res, [(0, 0), (0, 2)]).versions == ()  # one version: no marks


def test_a_tp_rank_counts_its_serve_slice_in_iterations_not_by_its_clock(w0):
    """A TP replica's ranks must run the same iterations between two calls: with a replica of
    two (`set_replica`) a slice is LOCKSTEP_ITERATIONS engine iterations whatever `max_s` says;
    one device alone stops at its deadline (here at once: one iteration)."""
    from dynaresize.cluster.worker_serve import LOCKSTEP_ITERATIONS

    alone = Server(w0, 0, partial=False)
    alone.serve([_req(0, 40)], 0.0)
    assert len(alone.engine.progress()[(3, 0, 0)][0]) == 1
    rank = Server(w0, 0, partial=False)
    rank._replica = ((0, 1), None)
    rank.serve([_req(0, 40)], 0.0)
    assert len(rank.engine.progress()[(3, 0, 0)][0]) == LOCKSTEP_ITERATIONS
    rank.serve((), 1e6)  # a long deadline does not lengthen it either
    assert len(rank.engine.progress()[(3, 0, 0)][0]) == 2 * LOCKSTEP_ITERATIONS
