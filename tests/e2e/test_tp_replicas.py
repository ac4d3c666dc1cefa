"""End to end: tensor-parallel rollout replicas (`rollout.tensor_parallel = 2`) on the real
runtime, Ray + gloo, the CPU build of vLLM, 6 devices.

A replica is two device workers, one vLLM TP rank in each (roles/vllm_tp.py), moved, served and
lost whole (cluster/replicas.py). Runs, all deterministic: one-step-off with a scripted move of a
replica to rollout and back, and the static run; the same at staleness 2 (the streaming router
serves each replica through both its ranks in lockstep). Each pair generates the same tokens and
ends with the same parameters. At most two replicas (four vLLM ranks) are alive at once.
"""

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.vllm  # skipped without vLLM, failed under CI (tests/conftest.py)

from dynaresize.config_load import build_config
from dynaresize.driver.run import run_job
from dynaresize.presets import preset
from dynaresize.records import read_records

from _runs import ray_local  # noqa: F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 4


def _cfg(staleness: int, faults=(), **policy):
    data = preset("cpu")
    data.update(steps=STEPS, deterministic=True, faults=list(faults))
    data["cluster"] = {**data["cluster"], "devices": 6, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "vllm", "tensor_parallel": 2}
    data["train"] = {**data["train"], "staleness": staleness}
    data["policy"] = policy
    return build_config(data)


def _sha(out):
    return {s["sample_id"]: s["token_sha1"] for s in read_records(out / "records.jsonl", "sample")}


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoint" / "model.safetensors"))


_RUNS: dict = {}


def _run(base, name: str, staleness: int, faults=(), **policy):
    """A run of this module, made once (the static runs serve two tests)."""
    key = (name, staleness, tuple(faults))
    if key not in _RUNS:
        out = base / f"{name.replace(':', '')}-{staleness}-{len(faults)}"
        _RUNS[key] = (out, run_job(_cfg(staleness, faults, name=name, **policy), out, progress=False))
    return _RUNS[key]


@pytest.fixture(scope="module")
def base(ray_local, tmp_path_factory):
    yield tmp_path_factory.mktemp("tp")
    _RUNS.clear()


@pytest.fixture(params=[1, 2], ids=["one-step-off", "staleness-2"])
def tp_pair(request, base):
    # the replica joins after step 0, so a step is released while it serves (streaming: step 3;
    # the engine already serving holds every share of the steps released before, up to its slots)
    out, moved = _run(base, "scripted", request.param, schedule="1:4,3:2")
    out_static, static = _run(base, "static:2", request.param)
    return out, moved, out_static, static


def test_a_tp2_replica_moves_each_way_whole_and_the_run_equals_the_static_one(tp_pair):
    out, summary, out_static, static = tp_pair
    for s in (summary, static):
        assert s["ledger_ok"], s["ledger_problems"]
    assert summary["resizes_to_rollout"] == 1 and summary["resizes_to_train"] == 1
    resizes = list(read_records(out / "records.jsonl", "resize"))
    # the replica after the first one (devices 2 and 3) joins rollout, then leaves it, whole
    assert [(r["to_role"], sorted(r["moving"])) for r in resizes] == [("rollout", [2, 3]), ("train", [2, 3])]
    loads = [o for o in read_records(out / "records.jsonl", "op") if o["name"] == "load_weights"]
    assert sorted(o["device"] for o in loads) == [2, 3]  # both ranks started their engine in the move
    # every rank of a replica is busy for what it ran: the same rollout spans on both its ranks
    spans = [(r["device"], r["start_s"], r["end_s"]) for r in read_records(out / "records.jsonl", "span")
             if r["name"] == "rollout"]
    of = lambda d: sorted((a, b) for dev, a, b in spans if dev == d)  # noqa: E731
    assert of(0) == of(1) and of(2) == of(3) and of(2) and not of(4) and not of(5)
    sha, sha_static = _sha(out), _sha(out_static)
    assert len(sha) == STEPS * 32 and sha == sha_static
    w, w_static = _weights(out), _weights(out_static)
    assert w.keys() == w_static.keys()
    assert max(float((w[k] - w_static[k]).abs().max()) for k in w) <= 1e-6


def test_a_killed_tp_rank_loses_its_replica_whole_and_the_run_recovers_equal(base):
    """Device 1 (the second rank of replica [0, 1]) dies mid-rollout: its peer's call is moot,
    the step's groups go back with their ids and seeds, the survivors re-form (5 devices: one
    replica of 2 and 3 trainers), and the run equals the uninterrupted static one."""
    out, summary = _run(base, "static:2", 1, faults=["kill:1@rollout:2"])
    out_static, _ = _run(base, "static:2", 1)
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["faults_injected"] == summary["faults_recovered"] == 1
    rec = list(read_records(out / "records.jsonl", "recovery"))
    assert [(r["lost_devices"], r["num_devices"]) for r in rec] == [([1], 5)]
    assert _sha(out) == _sha(out_static)
    w, w_static = _weights(out), _weights(out_static)
    assert max(float((w[k] - w_static[k]).abs().max()) for k in w) <= 1e-6
