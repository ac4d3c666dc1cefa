"""A per-step snapshot puts no call of its own on the step's path (driver/snapshots.py).

The request rides on the training call (the trainer starts the copy right after its optimizer
step, `TrainStageMixin._optimizer_step`), and the driver's `snapshot_take` calls are issued and
waited for by its collector thread, not the main thread. A training call without the request
falls back to the main thread's `snapshot_begin` + `snapshot_take`. Fakes stand in for the
workers and Ray's `get` (no actors here); how long anything takes is the bench's
(docs/faults.md), not these tests'.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dynaresize.config_load import build_config


class _Remote:
    def __init__(self, log: list, name: str, device: int) -> None:
        self.log, self.name, self.device = log, name, device

    def remote(self, *args):
        self.log.append((self.name, self.device, args, threading.current_thread().name))
        if self.name == "snapshot_take":
            meta = {"pieces": [[self.device * 4, self.device * 4 + 4]], "numel": 8, "seconds": 0.01,
                    "bytes": 16, "param_bytes": 16, "scalars": {}, "params": []}
            return (("meta", meta), ("param", self.device), ("others", self.device))
        return ("ref", self.name)


class _Worker:
    def __init__(self, log: list, device: int) -> None:
        self.snapshot_begin = _Remote(log, "snapshot_begin", device)
        self.snapshot_take = _Remote(log, "snapshot_take", device)


def _snapshots(monkeypatch, log: list):
    import ray

    from dynaresize.driver.snapshots import Snapshots

    monkeypatch.setattr(ray, "get", lambda refs, **_: [r[1] for r in refs])  # ("meta", meta) -> meta
    emitted: list[dict] = []
    rec = SimpleNamespace(emit=lambda kind, **f: emitted.append({"kind": kind, **f}))
    cluster = SimpleNamespace(nodes=None, workers=[_Worker(log, d) for d in range(2)],
                              node_of=lambda d: "n0")
    run = SimpleNamespace(cfg=build_config({"steps": 10, "checkpoint": {"snapshot_every_steps": 3}}),
                          cluster=cluster, rec=rec)
    snaps = Snapshots(run)
    snaps._t_prev = 0.0
    return snaps, emitted


def test_the_step_call_carries_the_request_and_the_main_thread_issues_nothing(monkeypatch):
    log: list = []
    snaps, emitted = _snapshots(monkeypatch, log)
    assert snaps.request(1) == (1, "params") and snaps.request(3) == (3, "full")
    stats = [{"device": d, "snap_wait_s": 0.0, "snapshot": [1, "params"]} for d in range(2)]
    snaps.after_train(0, stats, scored="step 0")
    snaps.begin(1, (0, 1))
    p = snaps.pending[1]
    assert p.done.wait(timeout=60)  # the collector's work, not a clock
    assert [e[0] for e in log] == ["snapshot_take", "snapshot_take"]  # no snapshot_begin call at all
    assert all(e[2] == (1,) for e in log)
    assert threading.current_thread().name not in {e[3] for e in log}  # issued off the main thread
    snaps.poll()
    assert 1 in snaps.done and snaps.done[1].others is None and not snaps.pending
    snaps.after_train(1, [{"device": d, "snap_wait_s": 0.0} for d in range(2)], scored="step 1")
    (row,) = [e for e in emitted if e["kind"] == "snapshot"]
    assert (row["step"], row["snapshot_kind"], row["cause"], row["bytes"]) == (1, "params", "step", 32)
    assert row["critical_s"] >= 0 and row["collector_s"] >= 0
    threads = snaps._collector.threads
    snaps.finish()  # the run's end: the collector's threads end too
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_a_step_call_without_the_request_falls_back_to_the_main_thread(monkeypatch):
    log: list = []
    snaps, _ = _snapshots(monkeypatch, log)
    snaps.after_train(0, [{"device": 0, "snapshot": [1, "params"]}, {"device": 1}], scored="step 0")  # one said no
    snaps.begin(1, (0, 1))
    assert [e[0] for e in log] == ["snapshot_begin", "snapshot_begin", "snapshot_take", "snapshot_take"]
    assert {e[3] for e in log} == {threading.current_thread().name}
    assert snaps.pending[1].done is None  # collected by the main thread's poll (ray.wait), as before


@pytest.mark.parametrize("request_", [(4, "full"), None])
def test_optimizer_step_starts_the_requested_copy_after_the_update(request_):
    from dynaresize.cluster.worker_train import TrainStageMixin

    order: list = []
    worker = SimpleNamespace(
        moments=SimpleNamespace(require_done=lambda: order.append("moments")),
        snapshot_gate=lambda: order.append("gate") or 0.0,
        trainer=SimpleNamespace(apply_optimizer=lambda: order.append("optimizer") or {}, step=4),
        snapshot_begin=lambda version, kind: order.append(("snapshot_begin", version, kind)),
        device=0)
    stats = TrainStageMixin._optimizer_step(worker, {}, 0.0, request_)
    if request_ is None:
        assert order == ["moments", "gate", "optimizer"] and "snapshot" not in stats
    else:
        assert order == ["moments", "gate", "optimizer", ("snapshot_begin", 4, "full")]
        assert stats["snapshot"] == [4, "full"]
