"""End to end: the streaming pipeline (`train.staleness = 2`) on the real runtime, Ray + gloo, CPU.

One scripted run with resizes each way and one static run, both deterministic, staleness 2
(the trainers accumulate each step in parts as its groups arrive): the ledger holds with every
`consumed_step - version <= 2` (and the bound is reached); the leaving engines hand their
requests in flight to the remaining one (`requests_moved` on the resize record), whose
critical path ends before those requests do; and the two runs generate the same tokens and
end with the same parameters (within 1e-6), though the static one also evaluates (which drains
every engine and gives it the newest version between windows). Responses are long (96 tokens)
so that rollout usually bounds a window here. A move with requests surely in flight is the paced
test at the end: emulated devices deliver each result at its modelled time, so at the move the
steps in flight are still running whatever this machine's speed.
"""

from collections import Counter

import pytest

pytest.importorskip("ray")

from dynaresize.config_load import build_config
from dynaresize.driver.run import run_job
from dynaresize.presets import preset
from dynaresize.records import read_records

from _runs import ray_local  # noqa: F401

pytestmark = pytest.mark.dist

STEPS = 6
ETA = 2


def _cfg(eval_every=0, **policy):
    data = preset("cpu")  # this machine's own speed: nothing paced
    data.update(steps=STEPS, deterministic=True, eval={"every_steps": eval_every, "num_prompts": 2,
                                                        "samples_per_prompt": 2})
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "hf", "prompts_per_step": 4, "samples_per_prompt": 4,
                       "max_new_tokens": 96}
    data["train"] = {**data["train"], "staleness": ETA}
    data["policy"] = policy
    return build_config(data)


@pytest.fixture(scope="module")
def stream_pair(ray_local, tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    s1 = run_job(_cfg(name="scripted", schedule="2:1,4:3"), base / "scripted", progress=False)
    s2 = run_job(_cfg(name="static:2", eval_every=3), base / "static", progress=False)  # evaluation drains
    return base / "scripted", s1, base / "static", s2


def test_staleness_2_with_resizes_keeps_the_ledger_and_the_bound(stream_pair):
    out, summary, _, static = stream_pair
    for s in (summary, static):
        assert s["ledger_ok"], s["ledger_problems"]
        assert s["staleness"] == ETA and s["max_staleness"] == ETA
    assert summary["resizes_to_rollout"] == 1 and summary["resizes_to_train"] == 1
    resizes = list(read_records(out / "records.jsonl", "resize"))
    assert [len(r["to"]["rollout"]) for r in resizes] == [1, 3]  # to train first, while rollout bounds a window
    # the rollout -> train move counts what its migrate_requests op handed on (how many were in
    # flight at the move depends on this machine's speed here; the paced test below requires some)
    assert "requests_moved" not in resizes[1] and isinstance(resizes[0]["requests_moved"], int)
    ops = [o for o in read_records(out / "records.jsonl", "op") if o["name"] == "migrate_requests"]
    assert sum(o["requests_moved"] for o in ops) == resizes[0]["requests_moved"] and len(ops) == 1
    # requests in flight per rollout device and window (a `concurrency` record each)
    conc = list(read_records(out / "records.jsonl", "concurrency"))
    # shares of 8 admitted while the slots allow: steps 0-2 at once on each engine at first
    assert {c["step"] for c in conc} == set(range(STEPS)) and max(c["peak"] for c in conc) >= 16
    assert summary["groups_created_critical"] == 0 and summary["world_inits_max"] == 1
    samples = list(read_records(out / "records.jsonl", "sample"))
    assert len({s["sample_id"] for s in samples}) == len(samples) == STEPS * 16
    lag = [s["consumed_step"] - s["version"] for s in samples]
    assert all(0 <= x <= ETA for x in lag) and ETA in lag
    # which weights generate a sample depends only on its step
    assert all(s["version"] == max(0, s["consumed_step"] - ETA) for s in samples)
    # the throughput model is told how many shares each step was cut into: one per rollout replica
    # at its release (16 samples: 2 shares of 8 on 2 replicas, 1 on 1, 3 of at most 6 on 3)
    chunks = [s["rollout_chunks"] for s in read_records(out / "records.jsonl", "step")]
    assert chunks[:3] == [2, 2, 2] and set(chunks) <= {1, 2, 3} and 1 in chunks
    # the trainers accumulated some step in parts as its groups arrived (a "train" span per part)
    parts = Counter((r["step"], r["device"]) for r in read_records(out / "records.jsonl", "span")
                    if r["name"] == "train")
    assert max(parts.values()) > 1 and {k for k, _ in parts} == set(range(STEPS))


def test_staleness_2_run_with_resizes_equals_static_run(stream_pair):
    from safetensors.torch import load_file

    out1, _, out2, _ = stream_pair
    sha1 = {s["sample_id"]: s["token_sha1"] for s in read_records(out1 / "records.jsonl", "sample")}
    sha2 = {s["sample_id"]: s["token_sha1"] for s in read_records(out2 / "records.jsonl", "sample")}
    assert len(sha1) == STEPS * 16 and sha1 == sha2
    w1 = load_file(str(out1 / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(out2 / "checkpoint" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6
    evals = list(read_records(out2 / "records.jsonl", "eval"))
    assert [(e["step"], e["version"]) for e in evals] == [(2, 3), (5, 6)]  # the newest weights


def test_streaming_takes_faults_and_checkpoints_and_refuses_a_staleness_above_the_bound():
    from dynaresize.errors import ConfigError

    data = preset("cpu")
    data["train"] = {**data["train"], "staleness": 2}
    cfg = build_config({**data, "faults": ["kill:1@train:2"], "checkpoint": {"every_steps": 2}})
    assert cfg.faults and cfg.checkpoint.every_steps == 2  # recovered and resumable (docs/faults.md)
    with pytest.raises(ConfigError, match="train.staleness=5"):
        build_config({**data, "train": {**data["train"], "staleness": 5}})


@pytest.mark.slow  # ~21 s, and timing-dependent in principle; the version marks are unit-tested (test_worker_serve.py)
def test_partial_rollout_run_records_token_versions_within_the_bound(ray_local, tmp_path):
    """Partial rollout at ETA = 2 (not deterministic): long-tailed synthetic lengths keep tails
    running when an engine's next share needs newer weights, so some samples span two versions;
    a rollout -> train move hands requests on with their prefix. Every sample's oldest version is
    within the bound, none newer than its consuming step; the ledger is whole."""
    data = preset("cpu")
    data.update(steps=STEPS, deterministic=False, policy={"name": "scripted", "schedule": "3:1"})
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "hf", "prompts_per_step": 4, "samples_per_prompt": 4,
                       "max_new_tokens": 192, "synthetic_lengths": True, "length_workload": "longtail-drift",
                       "partial": True}  # long tails: a newer version exists while some still decode
    data["train"] = {**data["train"], "staleness": ETA}
    summary = run_job(build_config(data), tmp_path / "partial", progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    samples = list(read_records(tmp_path / "partial" / "records.jsonl", "sample"))
    assert len({s["sample_id"] for s in samples}) == len(samples) == STEPS * 16
    assert all(0 <= s["consumed_step"] - s["version"] <= ETA for s in samples)
    spanned = [s for s in samples if s.get("versions")]
    assert spanned, "no sample spanned two weight versions"
    for s in spanned:
        versions = [v for v, _ in s["versions"]]
        firsts = [i for _, i in s["versions"]]
        # consecutive marks change version; the oldest is the sample's (a request moved under partial
        # rollout may go on under an older version than its prefix's newest: its step's)
        assert all(a != b for a, b in zip(versions, versions[1:])) and min(versions) == s["version"]
        assert versions[-1] <= s["consumed_step"] and firsts[0] == 0 and firsts == sorted(firsts)
        assert firsts[-1] < s["num_tokens"]
    resize = next(read_records(tmp_path / "partial" / "records.jsonl", "resize"))
    ops = [o for o in read_records(tmp_path / "partial" / "records.jsonl", "op") if o["name"] == "migrate_requests"]
    # how many were in flight depends on this machine's speed; what the move says it handed on is
    # what its migrate_requests op moved
    assert resize["to_role"] == "train" and len(ops) == 1 and resize["requests_moved"] == ops[0]["requests_moved"]


def _paced(policy: dict):
    """The streaming job on emulated H200s running a 7B (a long-tailed 7B rollout takes minutes of
    emulated time, its training seconds): at a window's end the next steps' requests are in flight
    by the model, not by this machine's speed. Time scale 20: a share's paced wall time (1-4 s)
    outlasts a window's real training here even on a loaded machine (engines hold every share of
    their version at once, so nothing but the pacing keeps a share in flight)."""
    data = preset("cpu")
    data.update(steps=4, deterministic=True, policy=policy)
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2, "emulate": "h200:7b", "time_scale": 20}
    data["rollout"] = {**data["rollout"], "engine": "hf", "prompts_per_step": 4, "samples_per_prompt": 4,
                       "max_new_tokens": 16, "length_workload": "longtail-drift"}
    data["train"] = {**data["train"], "staleness": ETA}
    return build_config(data)


def test_a_move_mid_rollout_hands_requests_on_without_waiting_for_them(ray_local, tmp_path):
    """A rollout -> train move before step 2 (paced: requests of steps 2-3 are in flight then)
    moves them to the remaining engine; the move's critical path ends long before they do; the
    ledger is whole and the run equals the static run (same tokens, final parameters within 1e-6)."""
    from safetensors.torch import load_file

    moved, static = tmp_path / "moved", tmp_path / "static"
    s1 = run_job(_paced({"name": "scripted", "schedule": "2:1"}), moved, progress=False)
    s2 = run_job(_paced({"name": "static:2"}), static, progress=False)
    assert s1["ledger_ok"] and s2["ledger_ok"], (s1["ledger_problems"], s2["ledger_problems"])
    (resize,) = read_records(moved / "records.jsonl", "resize")
    assert resize["to_role"] == "train" and resize["requests_moved"] > 0
    later = [r["end_s"] for r in read_records(moved / "records.jsonl", "span")
             if r["name"] == "rollout" and r["step"] > resize["step"]]
    assert max(later) > resize["t_s"] + resize["critical_s"]
    sha = lambda out: {r["sample_id"]: r["token_sha1"] for r in read_records(out / "records.jsonl", "sample")}  # noqa: E731
    assert len(sha(moved)) == 4 * 16 and sha(moved) == sha(static)
    w1, w2 = load_file(str(moved / "checkpoint" / "model.safetensors")), load_file(str(static / "checkpoint" / "model.safetensors"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-6


@pytest.mark.slow  # ~25-60 s here (64 requests a step on the HF engine)
def test_streaming_engines_hold_many_requests_at_once(ray_local, tmp_path):
    """Request-level admission, unpaced: with 16 prompts x 4 samples on 2 rollout devices a step
    is cut into two shares of 32 consecutive samples (pipeline/dispatch.stream_shares) and each
    engine admits shares while its `rollout.vllm_max_num_seqs` slots (64) allow: at the first
    window each holds its share of steps 0 and 1 at once, 64 requests (not one prompt group of 4
    at a time, as the router admitted before), and the two engines split each step evenly."""
    data = preset("cpu")
    data.update(steps=2, deterministic=True, policy={"name": "static:2"})
    data["cluster"] = {**data["cluster"], "devices": 4, "rollout_devices": 2}
    data["rollout"] = {**data["rollout"], "engine": "hf", "prompts_per_step": 16, "samples_per_prompt": 4,
                       "max_new_tokens": 8, "vllm_max_num_seqs": 64}
    data["train"] = {**data["train"], "staleness": ETA}
    summary = run_job(build_config(data), tmp_path / "run", progress=False)
    assert summary["ledger_ok"], summary["ledger_problems"]
    records = tmp_path / "run" / "records.jsonl"
    conc = [c for c in read_records(records, "concurrency") if c["step"] == 0]
    assert len(conc) == 2 and all(c["peak"] == 64 for c in conc), conc
    assert [s["rollout_chunks"] for s in read_records(records, "step")] == [2, 2]  # two shares a step
    by_device = Counter((s["consumed_step"], s["device"]) for s in read_records(records, "sample"))
    assert sorted(by_device.values()) == [32] * 4, by_device
