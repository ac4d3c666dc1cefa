"""The stages of a step on the cluster: rollout routed to the rollout devices, training on the
training devices (whole, or in parts as a streaming step's samples arrive), and the weight sync
from the training group's root to every rollout device. A mixin of `cluster.cluster.Cluster`:
it uses the cluster's workers, assignment, pacing, watchdog and fault points.

Rollout sends each rollout replica its whole share of the step at once (the simulator's split,
`pipeline.dispatch`), so an engine decodes as many requests as it can hold, not one prompt group;
a lost device's share goes back to the front of the queue with the same sample ids and seeds and
the next free replica takes it. Training gives
micro-batch i of a step to the trainer at position i mod W (composition fixed by sample
index). Every call's epoch times come back for the driver's `span` records.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dynaresize.cluster import replicas
from dynaresize.roles.base import GenRequest
from dynaresize.types import ROLLOUT, TRAIN


@dataclass
class RolloutOutcome:
    """Results of one rollout stage and how busy each rollout device was."""

    results: list[tuple[int, Any]]  # (device, GenResult)
    t0: float
    t1: float
    busy_s: dict[int, float]
    last_end: dict[int, float]
    calls: list[tuple[int, float, float]]  # (device, t0, t1) of every engine call
    # (device, admitted, finished) of every request delivered: its call's start, its last token
    requests: list[tuple[int, float, float]] = field(default_factory=list)
    remaining: list[list[GenRequest]] = field(default_factory=list)  # groups no device was left for
    reissued: list[tuple[int, int, int]] = field(default_factory=list)  # sample ids sent again after a loss


class StagesMixin:
    """Rollout, training and weight-sync methods of `Cluster` (see the module docstring)."""

    def rollout_async(self, step: int, groups: list[list[GenRequest]]) -> Future:
        """Run the rollout stage of `step` on a driver thread (it overlaps training)."""
        return self._executor.submit(self.rollout, step, groups, self.assignment.devices(ROLLOUT))

    def rollout(self, step: int, groups: list[list[GenRequest]], devices: tuple[int, ...]) -> RolloutOutcome:
        """A router over replica shares: each rollout replica gets its share of the step in
        one call (`pacing.rollout_chunks`); a free replica takes the next item while any is left.
        A replica is one device, or `rollout.tensor_parallel` devices that each get the call
        (cluster/replicas.py); its leader's answer is the replica's.

        A lost device's group goes back to the front of the queue (same ids and seeds) and the
        stage goes on with the other replicas (a replica with a lost rank is lost whole); groups
        left when no replica is left come back in `remaining`. Devices in the outcome are
        device ids (`ids`), not ranks."""
        self.reach("rollout", step, devices[:len(groups)])
        t0 = time.time()
        ids = self.ids
        queue = list(groups)
        reps = replicas.replica_of(replicas.replicas_of(devices, self.cfg.rollout.tensor_parallel))
        inflight: dict[Any, int] = {}  # every rank's ref -> rank
        sent: dict[int, tuple[list[GenRequest], replicas.ReplicaCall]] = {}  # leader -> its group, its call
        down = lambda d: any(r in self.watchdog.lost for r in reps[d])  # noqa: E731
        free = [d for d in devices if d == reps[d][0] and not down(d)]
        queue = self.pacing.rollout_chunks(step, queue, len(free))  # one share per replica, paced or not
        out: list[tuple[int, Any]] = []
        busy = {ids[d]: 0.0 for d in devices}
        last_end = {ids[d]: t0 for d in devices}
        calls: list[tuple[int, float, float]] = []
        requests: list[tuple[int, float, float]] = []
        reissued: list[tuple[int, int, int]] = []
        tracker = self.watchdog.tracker(f"rollout {step}")
        while queue or sent:
            while queue and free:
                d = free.pop(0)
                pace_s = getattr(queue[0], "pace_s", None)  # emulated busy seconds (pacing.py)
                call = replicas.ReplicaCall(
                    lambda r: self.pacing.call(self.workers[r], "generate", queue[0], step, pace_s=pace_s), reps[d])
                inflight.update(call.refs)
                sent[d] = (queue.pop(0), call)
            if not sent:
                break  # groups left and no rollout replica left: the caller recovers first
            done, _ = tracker.poll(inflight, first=True)
            for ref, r, ok, res in done:
                d = reps[r][0]
                # a rank of a replica already lost: its answer (or error) is moot; else wait for all
                if d not in sent or down(d) or not sent[d][1].take(ref, res):
                    continue
                first = sent.pop(d)[1].result()
                self.pacing.note(first)
                out.extend((ids[d], x) for x in first["results"])
                # a paced share is in flight for the replica's modelled time (its real work is tiny)
                paced = "paced_s" in first
                requests.extend((ids[d], first["t0"], first["t1"] if paced else min(first["t0"] + x.duration_s,
                                                                                    first["t1"]))
                                for x in first["results"])
                for rank in reps[d]:  # every rank of a replica was busy for it
                    busy[ids[rank]] += first["t1"] - first["t0"]
                    last_end[ids[rank]] = max(last_end[ids[rank]], first["t1"])
                    calls.append((ids[rank], first["t0"], first["t1"]))
                free.append(d)
            for d in [d for d in sent if down(d)]:  # a rank of it was lost
                group, call = sent.pop(d)
                for ref in call.refs:
                    inflight.pop(ref, None)
                reissued += [req.sample_id for req in group]
                queue.insert(0, group)
            free = [d for d in free if not down(d)]
        return RolloutOutcome(results=out, t0=t0, t1=time.time(), busy_s=busy, last_end=last_end, calls=calls,
                              remaining=queue, reissued=reissued, requests=requests)

    def train(self, step: int, micro_batches: list[list[Any]], total_tokens: int, *,
              snapshot: tuple[int, str] | None = None) -> list[dict]:
        """One training step: micro-batch i goes to the (i mod W)-th training device.
        `snapshot` (version, kind): each trainer starts that snapshot's copy right after its
        optimizer step, inside this call (driver/snapshots.py)."""
        devices = self.assignment.devices(TRAIN)
        per = self._by_position(list(enumerate(micro_batches)), devices)
        self.reach("train", step, devices)
        pace_s = self.pacing.train_s(step, len(devices))
        extra = {"snapshot": snapshot} if snapshot is not None else {}
        refs = [self.pacing.call(self.workers[d], "train", step, per[d], len(micro_batches), total_tokens,
                                 pace_s=pace_s, **extra) for d in devices]
        return self._train_wait(step, devices, refs)

    def train_part(self, step: int, micro_batches: list[tuple[int, list[Any]]], *, begin: bool,
                   num_micro_batches: int, total_tokens: int | None,
                   snapshot: tuple[int, str] | None = None) -> list[dict]:
        """Part of a streaming step's training (the trainers accumulate as its groups arrive):
        micro-batches (index, samples) of the step, micro-batch i on the (i mod W)-th training
        device as in `train`; the part with `total_tokens` applies the optimizer step
        (`DeviceWorker.train_part`), and starts the copy of `snapshot` as `train` does. Emulated,
        paced to these samples' share of the step's training compute, plus the fixed exposed
        time on the last part."""
        devices = self.assignment.devices(TRAIN)
        per = self._by_position(micro_batches, devices)
        rounds = max((len(v) for v in per.values()), default=0)
        if begin:
            self.reach("train", step, devices)
        samples = [s for _, mb in micro_batches for s in mb]
        pace_s = self.pacing.train_part_s(step, samples, len(devices), last=total_tokens is not None)
        extra = {"snapshot": snapshot} if snapshot is not None and total_tokens is not None else {}
        refs = [self.pacing.call(self.workers[d], "train_part", step, per[d], rounds, begin, num_micro_batches,
                                 total_tokens, pace_s=pace_s, **extra) for d in devices]
        return self._train_wait(step, devices, refs)

    @staticmethod
    def _by_position(micro_batches: list[tuple[int, Any]], devices) -> dict[int, list[tuple[int, Any]]]:
        per: dict[int, list[tuple[int, Any]]] = {d: [] for d in devices}
        for i, mb in micro_batches:
            per[devices[i % len(devices)]].append((i, mb))
        return per

    def _train_wait(self, step: int, devices, refs: list) -> list[dict]:
        stats = self.wait(list(zip(devices, refs)), f"train {step}")
        for st in stats:
            self.pacing.note(st)
        return [{**st, "device": self.ids[d]} for d, st in zip(devices, stats)]

    def sync_weights(self, version: int, step: int) -> list[dict]:
        """Weights of `version` to every rollout device: all trainers gather them (FSDP), the
        first sends them over the cached sync group. Entries for the sync group's devices."""
        a = self.assignment
        train, rollout = a.devices(TRAIN), a.devices(ROLLOUT)
        if not rollout:
            return []
        ranks = tuple(sorted((train[0], *rollout)))
        devices = tuple(sorted(set(train) | set(rollout)))
        self.reach("weight_sync", step, ranks)
        out = self.wait([(d, self.pacing.call(self.workers[d], "sync_weights", train[0], ranks, version, step,
                                              pace_s=self.pacing.sync_s())) for d in devices], f"weight sync {version}")
        for r in out:
            self.pacing.note(r, stage=False)
        measured = [r["changed_fraction"] for r in out if r.get("changed_fraction") is not None and "wire_dtype" in r]
        if measured and self.pacing.emulator is not None:  # delta sync: later syncs paced at what this one measured
            self.pacing.emulator.sync_changed("delta", sum(measured) / len(measured))
        return [{**r, "device": self.ids[d]} for d, r in zip(devices, out) if d in ranks]
