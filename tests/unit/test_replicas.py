"""Rollout replicas of several devices (cluster/replicas.py): how rollout ranks group into
replicas, how one call to every rank of a replica is answered, and the bounds that keep the
rollout pool a whole number of replicas (emulate/model.py run_bounds)."""

from types import SimpleNamespace

import pytest

from dynaresize.cluster import replicas
from dynaresize.config_load import build_config
from dynaresize.emulate.model import run_bounds
from dynaresize.errors import ConfigError
from dynaresize.roles.base import GenResult


def test_replicas_are_consecutive_chunks_of_the_rollout_ranks_on_one_node():
    assert replicas.replicas_of([5, 4, 1, 0], 2) == [(0, 1), (4, 5)]
    assert replicas.replicas_of([0, 1, 2], 1) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="whole number of replicas of 2"):
        replicas.replicas_of([0, 1, 2], 2)
    node = {0: "a", 1: "a", 2: "a", 3: "b"}.__getitem__
    assert replicas.replicas_of([0, 1], 2, node) == [(0, 1)]
    with pytest.raises(RuntimeError, match=r"replica \[2, 3\] spans nodes \['a', 'b'\]"):
        replicas.replicas_of([0, 1, 2, 3], 2, node)


def _answer(device: int, ids, running: int) -> dict:
    res = [GenResult(sample_id=s, response_ids=[1], logprobs=[0.0], version=0, duration_s=0.0) for s in ids]
    return {"results": res, "running": running, "device": device}


def test_a_replica_call_ends_when_every_rank_answered_and_answers_for_the_leader():
    call = replicas.ReplicaCall(lambda d: f"ref{d}", (4, 5))
    assert call.leader == 4 and call.refs == {"ref4": 4, "ref5": 5}
    assert not call.take("ref5", _answer(5, [(0, 0, 1)], 2))  # the other rank first
    assert call.take("ref4", _answer(4, [(0, 0, 1)], 2))
    assert call.result()["device"] == 4


def test_diverged_ranks_and_a_rank_error_are_raised():
    call = replicas.ReplicaCall(lambda d: d, (0, 1))
    call.take(0, _answer(0, [(0, 0, 1)], 1))
    call.take(1, _answer(1, [(0, 0, 2)], 1))
    with pytest.raises(RuntimeError, match="tensor-parallel ranks diverged"):
        call.result()
    call = replicas.ReplicaCall(lambda d: d, (0, 1))
    call.take(0, _answer(0, [], 1))
    call.take(1, ValueError("engine broke"))
    with pytest.raises(ValueError, match="engine broke"):
        call.result()


def test_place_sends_a_fresh_rendezvous_to_every_rank_of_tp_replicas_only():
    sent = []

    class _W:
        def __init__(self, d):
            self.set_replica = SimpleNamespace(remote=lambda ranks, addr, port: sent.append((d, tuple(ranks), port)))

    workers = [_W(d) for d in range(6)]
    answers = iter([5000, 5000, 5001])  # the node hands the same free port out twice: asked again
    placed = replicas.place(workers, [(0,), (2, 3), (4, 5)], lambda d: "10.0.0.1", lambda d: next(answers))
    assert [d for d, _ in placed] == [2, 3, 4, 5]
    assert sent == [(2, (2, 3), 5000), (3, (2, 3), 5000), (4, (4, 5), 5001), (5, (4, 5), 5001)]


def test_bounds_keep_the_rollout_pool_whole_replicas():
    b = run_bounds(build_config({"cluster": {"devices": 6}, "rollout": {"tensor_parallel": 2}}))
    assert (b.move_unit, b.min_rollout) == (2, 2) and b.splits() == (2, 4)
    b = run_bounds(build_config({"cluster": {"devices": 8}, "rollout": {"tensor_parallel": 2},
                                 "policy": {"move_unit": 3}}))
    assert (b.move_unit, b.min_rollout) == (4, 4) and b.splits() == (4,)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel=2: emulated runs"):
        run_bounds(build_config({"cluster": {"devices": 8, "emulate": "h100:7b", "rollout_devices": 2},
                                 "rollout": {"tensor_parallel": 2}}))
