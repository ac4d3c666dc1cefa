"""Delta weight sync end to end: the real runtime on Ray + gloo, HF engines in bf16.

A bf16 run at lr 1e-6 over 8 steps with a move each way, once with `rollout.weight_sync=delta`
and once with `full`, same seed: every delta sync after the first full one sends at most 10% of
a full sync's bytes; after every sync each engine holds the trainers' weights cast to bf16
(their digests, read back from the engines, compared after each sync from the driver); the two
runs' tokens are equal for every sample. And deterministic mode (fp32 engines) with delta sync
and moves each way equals the static full-sync run (tokens, parameters within 1e-6).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from dynaresize.cluster.cluster import Cluster  # noqa: E402
from dynaresize.config_load import build_config  # noqa: E402
from dynaresize.driver.run import run_job  # noqa: E402
from dynaresize.presets import preset  # noqa: E402
from dynaresize.records import read_records  # noqa: E402
from dynaresize.types import ROLLOUT, TRAIN  # noqa: E402

from _runs import ray_local  # noqa: E402,F401

pytestmark = [pytest.mark.dist, pytest.mark.slow]
SCHEDULE = "2:3,5:2"  # after step 1 a trainer leaves for rollout, after step 4 it comes back



def _cfg(**rollout):
    data = preset("cpu")
    data["steps"] = 8
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "hf", "prompts_per_step": 4, "samples_per_prompt": 4,
                       "max_new_tokens": 16, **rollout}
    data["train"] = {**data.get("train", {}), "lr": 1e-6}
    data["policy"] = {"name": "scripted", "schedule": SCHEDULE}
    return build_config(data)


def _digests_after_each_sync(monkeypatch) -> list[tuple[int, str, list[str]]]:
    """After each weight sync: (version, the trainers' bf16-cast digest, each engine's digest)."""
    seen: list[tuple[int, str, list[str]]] = []
    original = Cluster.sync_weights

    def checked(self, version, step):
        out = original(self, version, step)
        train, rollout = self.assignment.devices(TRAIN), self.assignment.devices(ROLLOUT)
        want = self.wait([(d, self.workers[d].param_digest.remote("bfloat16")) for d in train], "digest")[0]
        got = self.wait([(d, self.workers[d].engine_digest.remote()) for d in rollout], "engine digest")
        seen.append((version, want, got))
        return out

    monkeypatch.setattr(Cluster, "sync_weights", checked)
    return seen


@pytest.fixture(scope="module")
def bf16_pair(ray_local, tmp_path_factory):
    base = tmp_path_factory.mktemp("delta")
    mp = pytest.MonkeyPatch()
    try:
        seen = _digests_after_each_sync(mp)
        run_job(_cfg(dtype="bf16", weight_sync="delta"), base / "delta", progress=False)
        delta_seen = list(seen)
    finally:
        mp.undo()
    run_job(_cfg(dtype="bf16", weight_sync="full"), base / "full", progress=False)
    return base / "delta", delta_seen, base / "full"


def test_bf16_delta_sync_run_with_moves(bf16_pair):
    delta, seen, full = bf16_pair
    recs = list(read_records(delta / "records.jsonl", "weight_sync"))
    full_recs = list(read_records(full / "records.jsonl", "weight_sync"))
    assert {r["mode"] for r in full_recs} == {"full"}
    full_bytes = full_recs[0]["wire_bytes"]
    assert all(r["wire_bytes"] == full_bytes for r in full_recs)
    modes = [(r["step"], r["mode"]) for r in recs]
    assert modes[0][1] == "full" and sum(m == "delta" for _, m in modes) >= 10, modes
    for r in recs:
        if r["mode"] == "delta":
            assert r["wire_bytes"] <= 0.10 * full_bytes, r
            assert r["changed_fraction"] is not None and r["refetched_buckets"] == 0
        else:
            assert r["wire_bytes"] >= full_bytes and r["changed_fraction"] is None
    # a move each way happened, and the joining engine's sync was full
    resizes = list(read_records(delta / "records.jsonl", "resize"))
    assert {r["to_role"] for r in resizes} == {"rollout", "train"}
    # the engines hold the trainers' bf16 weights after every sync (digest)
    assert [v for v, _, _ in seen] == list(range(1, 9))
    for version, want, got in seen:
        assert got and all(g == want for g in got), version
    # the same tokens as the full-sync run, for every sample
    sha = lambda d: {s["sample_id"]: s["token_sha1"] for s in read_records(d / "records.jsonl", "sample")}  # noqa: E731
    a, b = sha(delta), sha(full)
    assert len(a) == 8 * 16 and a == b
    steps = list(read_records(delta / "records.jsonl", "step"))
    assert all("sync_s" in s for s in steps)


def test_deterministic_delta_sync_with_moves_equals_static_full_sync(ray_local, tmp_path):
    from safetensors.torch import load_file

    moved = _cfg(weight_sync="delta")
    data_static = {"policy": {"name": "static:2"}, "rollout": {"weight_sync": "full"}}
    from dynaresize.config_load import config_to_dict, merge

    det = lambda c, over: build_config(merge(config_to_dict(c), {"deterministic": True, "train": {"lr": 1e-3}, **over}))  # noqa: E731
    s1 = run_job(det(moved, {}), tmp_path / "delta", progress=False)
    s2 = run_job(det(moved, data_static), tmp_path / "full", progress=False)
    assert s1["ledger_ok"] and s2["ledger_ok"]
    recs = list(read_records(tmp_path / "delta" / "records.jsonl", "weight_sync"))
    assert any(r["mode"] == "delta" for r in recs) and recs[0]["wire_dtype"] == "float32"
    full_bytes = recs[0]["wire_bytes"]
    for r in recs:  # fp32: a step changes nearly every value, so a delta sends them all (correct, not smaller)
        if r["mode"] == "delta":
            assert r["changed_fraction"] > 0.9 and r["wire_bytes"] >= 0.9 * full_bytes and r["refetched_buckets"] == 0
    resizes = list(read_records(tmp_path / "delta" / "records.jsonl", "resize"))
    assert {r["to_role"] for r in resizes} == {"rollout", "train"}
    sha = lambda d: {s["sample_id"]: s["token_sha1"] for s in read_records(d / "records.jsonl", "sample")}  # noqa: E731
    a = sha(tmp_path / "delta")
    assert len(a) == 8 * 16 and a == sha(tmp_path / "full")
    w1 = load_file(str(tmp_path / "delta" / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6
