"""Pure parts of fault handling: fault specs, which device fires when, snapshot layouts, the
rolled-back tail of a resumed run's records, the one-line rollout-version rule."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dynaresize.cluster.faults import FaultInjector, parse_faults
from dynaresize.cluster.snapshot import Snapshot
from dynaresize.errors import ConfigError
from dynaresize.pipeline.stepstate import StepRollout, rollout_version


def test_parse_faults_lists_every_bad_spec():
    ok = parse_faults(["kill:1@train:3", "stop:0@resize.switch:2"], 4)
    assert [(f.kind, f.device, f.point, f.step) for f in ok] == [("kill", 1, "train", 3), ("stop", 0, "resize.switch", 2)]
    with pytest.raises(ConfigError) as exc:
        parse_faults(["kill:9@train:1", "nap:1@train:1", "kill:1@nowhere:1"], 4)
    assert len(exc.value.errors) == 3 and "device 9 outside 0..3" in exc.value.errors[0]


class _Worker:
    def __init__(self, log, device):
        self.log, self.device = log, device
        self.fault_now = SimpleNamespace(remote=lambda kind: log.append((device, kind)))


def test_faulted_device_outside_the_point_fires_now_and_inside_fires_in_its_call():
    inj = FaultInjector(parse_faults(["kill:1@train:2", "stop:3@train:2", "kill:0@rollout:5"], 4))
    log: list = []
    workers = {d: _Worker(log, d) for d in range(4)}
    inj.reach("train", 1, [2, 3], workers.__getitem__, lambda d: True)  # another step: nothing
    assert inj.num_fired == 0
    inj.reach("train", 2, [2, 3], workers.__getitem__, lambda d: True)
    assert log == [(1, "kill")]  # device 3 takes part: its own call fires the fault
    assert inj.num_fired == 2
    inj.reach("train", 2, [2, 3], workers.__getitem__, lambda d: True)  # a redone step fires nothing again
    assert inj.num_fired == 2
    assert inj.attribute(3).spec.kind == "stop" and inj.attribute(3) is None  # one loss, one fault
    assert inj.attribute(0) is None  # its fault never fired: a loss of device 0 is not injected
    assert inj.unfired() == ["kill:0@rollout:5"]  # the summary's faults_unfired


def _snap(pieces, others=True):
    """Shards given by their pieces (global ranges), in any order."""
    numel = max(hi for ps in pieces for _, hi in ps)
    metas = [{"pieces": [list(p) for p in ps], "numel": numel, "scalars": {}} for ps in pieces]
    names = [f"{ps[0][0]}" for ps in pieces]
    return Snapshot(version=3, metas=metas, params=[f"p{n}" for n in names],
                    others=[f"o{n}" for n in names] if others else None)


def test_snapshot_gives_each_new_rank_only_the_shards_it_overlaps():
    snap = _snap([[(6, 8), (12, 14)], [(0, 3), (8, 10)], [(3, 6), (10, 12)]])
    metas, refs = snap.train_args([[0, 4], [9, 10]])
    assert refs == ["p0", "o0", "p3", "o3"]
    metas, refs = snap.train_args([[7, 8]])
    assert refs == ["p6", "o6"] and metas[0]["pieces"] == [[6, 8], [12, 14]]
    with pytest.raises(ValueError, match="do not tile"):
        _snap([[(0, 3)], [(4, 10)]])
    with pytest.raises(ValueError, match="parameters only"):
        _snap([[(0, 10)]], others=False).train_args([[0, 10]])


def test_rollout_version_rule():
    assert [rollout_version(s, 1) for s in range(4)] == [0, 0, 1, 2]
    assert [rollout_version(s, 0) for s in range(3)] == [0, 1, 2]


def test_step_rollout_gathers_attempts():
    buf = StepRollout(step=2, remaining=[["g0"], ["g1"]])
    first = SimpleNamespace(results=[(0, "r0")], calls=[(0, 1.0, 2.0)], busy_s={0: 1.0}, last_end={0: 2.0},
                            t0=1.0, t1=2.5, remaining=[["g1"]], reissued=[(2, 1, 0)], requests=[(0, 1.0, 1.5)])
    second = SimpleNamespace(results=[(1, "r1")], calls=[(1, 3.0, 4.0)], busy_s={1: 1.0}, last_end={1: 4.0},
                             t0=3.0, t1=4.0, remaining=[], reissued=[], requests=[(1, 3.0, 4.0)])
    buf.absorb(first)
    assert not buf.done
    buf.absorb(second)
    assert buf.done and buf.results == [(0, "r0"), (1, "r1")] and (buf.t0, buf.t1) == (1.0, 4.0)
    assert buf.requests == [(0, 1.0, 1.5), (1, 3.0, 4.0)]  # every attempt's requests, for concurrency records
    assert buf.reissued == {(2, 1, 0)}


def test_resume_rolls_back_samples_consumed_after_the_checkpoint(tmp_path):
    from dynaresize.driver.checkpointing import ResumePoint, end_partial_line, resume_records
    from dynaresize.records import Recorder

    path = tmp_path / "records.jsonl"
    head = [{"kind": "sample", "sample_id": "0-0-0", "consumed_step": 0, "dropped": None}]
    tail = [{"kind": "sample", "sample_id": "1-0-0", "version": 0, "device": 1, "num_tokens": 3, "token_sha1": "x",
             "reward": 1.0, "consumed_step": 1, "dropped": None},
            {"kind": "step", "step": 1}]
    text = "".join(json.dumps(r) + "\n" for r in head)
    offset = len(text.encode())
    path.write_text(text + "".join(json.dumps(r) + "\n" for r in tail) + '{"kind": "sam')  # cut by a crash
    end_partial_line(path)
    run = SimpleNamespace(rec=Recorder(path), cfg=SimpleNamespace(cluster=SimpleNamespace(devices=3)),
                          assignment=SimpleNamespace(num_rollout=1))
    point = ResumePoint(run_dir=tmp_path, step_dir=tmp_path / "ck", boundary=1, rollout_version=0,
                        driver={"records_offset": offset})
    resume_records(run, point)
    run.rec.close()
    lines = path.read_text().splitlines()
    assert lines[-3] == '{"kind": "sam'  # the cut line stays as it was, on its own line
    rolled, resume = json.loads(lines[-2]), json.loads(lines[-1])
    assert rolled["sample_id"] == "1-0-0" and rolled["consumed_step"] is None
    assert rolled["dropped"].startswith("rolled back")
    assert resume["kind"] == "resume" and resume["rolled_back_samples"] == 1
