"""Device-worker methods for liveness, faults, snapshots and recovery (mixed into DeviceWorker).

Threads (see cluster/worker.py): `ctl` is a third, always-free thread for liveness pings and
injected faults, so a worker busy computing still answers "alive", and a worker that answers
nothing is stuck as a whole. `settle` (the issuing thread) returns only once every earlier
call on that thread has ended: the driver's proof that a survivor is no longer inside a
collective of the lost world (no other thread issues any).

Snapshots: after a training step every trainer copies its state to host memory on a copy thread
(`snapshot_begin`, on the issuing thread so it falls between the two steps; the parameters
only, or every kind every K steps: driver/snapshots.py) and returns it as task results from
the `snap` thread (`snapshot_take`, three returns: a small meta dict with its pieces of the
layout, its parameter pieces, and the other kinds: optimizer moments and reference weights).
The next optimizer step waits for the copy (`snapshot_gate`): that wait is the snapshot's only
part on the step's critical path.
Ray keeps results owned by the driver in the object store of the trainer's node, so they
outlive the trainer process: survivors restore from them (`restore_train`, reading only the
ranges they own in the new layout; `restore_rollout`, the full weights of a given version).

Replicas: `hold_replica` keeps another node's snapshot shard (its arrays, read-only views of
this node's object-store copy, which stays pinned while they are held) for the last versions,
so the shard outlives its node (cluster/snapshot.py); after a node loss, `copy_shard` re-makes
a shard from this node's copy as new objects (re-homing). Both run on the `ctl` thread, so a
worker busy computing takes and gives copies at once.

Recovery: `reset_world` leaves the old world (destroying it frees every group of it), clears
the communicator pool (counts kept), takes the new rank and joins the new generation on a
fresh port (a fresh TCP store, so no key of the old world can be seen). The trainer is
dropped: trainer state always comes back from a snapshot, never from a half-finished step.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from contextlib import nullcontext as _nullcontext
from typing import Any, Callable, Sequence

import numpy as np
import ray
import torch

from dynaresize.cluster.faults import fire
from dynaresize.comm import rendezvous
from dynaresize.reshard.sources import ShardSource, array_fetch
from dynaresize.roles.weight_sync import Staging, host_weights


class _SnapJob:
    """One host copy of a trainer's state, on its own thread: device -> (pinned) host, on a side
    CUDA stream that waits for `event` (the step's kernels), so it overlaps the next step's
    forward and backward; on the CPU a plain copy (numpy releases the GIL)."""

    def __init__(self, meta: dict, pieces: dict[str, list], dtypes: dict, event: Any) -> None:
        self.meta, self.done, self.seconds = meta, threading.Event(), 0.0
        self.t0 = self.t1 = time.time()
        self._out: dict[str, np.ndarray] = {}
        self._err: BaseException | None = None
        threading.Thread(target=self._copy, args=(pieces, dtypes, event), daemon=True).start()

    def _copy(self, pieces: dict[str, list], dtypes: dict, event: Any) -> None:
        self.t0 = time.time()
        try:
            stream = None
            if event is not None:
                stream = torch.cuda.Stream()
                stream.wait_event(event)
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                for kind, parts in pieces.items():
                    n = sum(int(t.numel()) for t in parts)
                    buf = torch.empty(n, dtype=dtypes[kind], pin_memory=stream is not None)
                    off = 0
                    for t in parts:
                        buf[off:off + t.numel()].copy_(t.reshape(-1), non_blocking=stream is not None)
                        off += t.numel()
                    self._out[kind] = buf
            if stream is not None:
                stream.synchronize()
            self._out = {k: v.numpy() for k, v in self._out.items()}
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of `result`
            self._err = exc
        finally:
            self.t1 = time.time()
            self.seconds = self.t1 - self.t0
            self.done.set()

    @classmethod
    def failed(cls, exc: BaseException) -> "_SnapJob":
        job = cls.__new__(cls)
        job.meta, job.done, job.seconds, job._out, job._err = {}, threading.Event(), 0.0, {}, exc
        job.t0 = job.t1 = time.time()
        job.done.set()
        return job

    def result(self) -> dict[str, np.ndarray]:
        self.done.wait()
        if self._err is not None:
            raise self._err
        return dict(self._out)


def _source(metas: Sequence[dict], arrays: Sequence[dict], partial: bool) -> ShardSource:
    """The state of snapshot shards `metas` (their arrays in the same order) as one source."""
    return ShardSource([(m["pieces"], array_fetch(a)) for m, a in zip(metas, arrays)], int(metas[0]["numel"]),
                       "snapshot", partial=partial)


class RecoveryMixin:
    """Methods of `DeviceWorker` for faults and recovery (attributes: see DeviceWorker)."""

    # ------------------------------------------------------------------ liveness and faults

    @ray.method(concurrency_group="ctl")
    def alive(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="ctl")
    def fault_now(self, kind: str) -> None:
        fire(kind)

    def settle(self) -> int:
        return self.device

    # ------------------------------------------------------------------ new world generation

    def reset_world(self, init_method: str, rank: int, world_size: int, generation: int) -> dict:
        t0 = time.time()
        rendezvous.destroy_world()
        if self.pool is not None:
            self.pool.clear()
        self.device = int(rank)
        self._drop_trainer()
        self.moments.reset()  # the moments of a resize cut short come back from the snapshot
        self._full, self._full_version = None, None  # a resize cut short left them
        if self._parked is not None:  # a parked engine belongs to the old world's plan
            self._parked.release()
            self._parked = None
        t1 = time.time()
        rendezvous.init_world(rank=self.device, world_size=world_size, init_method=init_method,
                              backend=self.cfg.cluster.backend, timeout_s=self.cfg.timeouts.collective_s,
                              generation=generation)
        return {"t0": t0, "t_destroyed": t1, "t1": time.time(), "world_inits": rendezvous.world_inits()}

    # ------------------------------------------------------------------ snapshots

    @ray.method(num_returns=3)
    def snapshot_state(self, version: int) -> tuple[dict, np.ndarray, dict]:
        """A full snapshot now, on the issuing thread (a blocking one: start, resume, checkpoints)."""
        self.snapshot_begin(version, "full")
        return self.snapshot_take(version)

    def snapshot_begin(self, version: int, kind: str) -> dict:
        """Start the host copy of this trainer's state at `version` (`kind`: "full", every kind;
        "params": the parameters only) on a copy thread, and return at once. On the issuing thread,
        in the driver's order: it runs after the step that made `version` and before the next one,
        whose optimizer step waits for the copy (`snapshot_gate`), so the copy reads `version`."""
        try:
            job = self._snap_job(version, kind)
        except Exception as exc:
            job = _SnapJob.failed(exc)  # its `snapshot_take` raises it (it waits for this job)
            raise
        finally:
            self._snap_put(version, job)
        return {"device": self.device, "version": version}

    def _snap_put(self, version: int, job: "_SnapJob") -> None:
        with self._snap_cv():
            self.__dict__.setdefault("_snap_jobs", {})[version] = job
            self._snap_cv().notify_all()

    def _snap_cv(self) -> threading.Condition:
        return self.__dict__.setdefault("_snap_cond", threading.Condition())  # atomic under the GIL

    def _snap_job(self, version: int, kind: str) -> "_SnapJob":
        tr = self.trainer
        if tr is None or tr.step != version:
            raise RuntimeError(f"snapshot of version {version} asked, device {self.device} holds "
                               f"{None if tr is None else tr.step}")
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(tr.spec.optim).items()}
        meta = {"version": version, "index": tr.index, "pieces": [list(p) for p in tr.local_pieces()],
                "numel": tr.layout.numel, "layout": tr.layout.describe(), "scalars": tr.scalars(),
                "params": tr.param_meta(), "settings": settings, "snapshot_kind": kind}
        kinds = tuple(tr.spec.kinds()) if kind == "full" else ("param",)
        pieces = {k: list(tr.pieces(k)) for k in kinds}  # live views: the next optimizer step waits for the copy
        event = None
        if self.torch_device.type == "cuda":  # the copy stream starts after the step's kernels issued so far
            event = torch.cuda.Event()
            event.record()
        return _SnapJob(meta, pieces, {k: tr.spec.dtype_of(k) for k in kinds}, event)

    @ray.method(concurrency_group="snap", num_returns=3)
    def snapshot_take(self, version: int) -> tuple[dict, np.ndarray, dict]:
        """The copy `snapshot_begin` started, once done, as three task results (meta, parameters,
        the other kinds): they go to this node's object store from the `snap` thread, off the
        issuing thread, and outlive this process (Ray keeps results owned by the driver)."""
        with self._snap_cv():  # the `snap` thread may get here before the issuing thread began it
            self._snap_cv().wait_for(lambda: version in self.__dict__.get("_snap_jobs", {}))
            job = self._snap_jobs[version]
        try:
            arrays = job.result()
        finally:
            with self._snap_cv():  # kept until done: `snapshot_gate` waits for every copy it finds
                self._snap_jobs.pop(version, None)
        meta = {**job.meta, "seconds": job.seconds, "t0": job.t0, "t1": job.t1,
                "bytes": int(sum(a.nbytes for a in arrays.values())), "param_bytes": int(arrays["param"].nbytes)}
        param = arrays.pop("param")
        return meta, param, arrays

    def snapshot_gate(self) -> float:
        """Wait for the copies still running (before the state changes: an optimizer step);
        the seconds waited, the part of a snapshot on the step's critical path."""
        t0 = time.time()
        with self._snap_cv():
            jobs = list(self.__dict__.get("_snap_jobs", {}).values())
        for job in jobs:
            job.done.wait()
        return time.time() - t0

    @ray.method(concurrency_group="ctl")
    def hold_replica(self, version: int, keep_from: int, index: int, param: np.ndarray, others: dict) -> dict:
        """Keep a copy of shard `index` of the snapshot of `version`; drop those of versions < `keep_from`."""
        held = self.__dict__.setdefault("_replicas", {})
        for key in [k for k in held if k[0] < keep_from]:
            del held[key]
        held[(version, index)] = (param, others)
        nbytes = param.nbytes + sum(getattr(v, "nbytes", 0) for v in others.values())
        return {"device": self.device, "version": version, "bytes": int(nbytes),
                "held": sorted({k[0] for k in held})}

    @ray.method(concurrency_group="ctl", num_returns=2)
    def copy_shard(self, param: np.ndarray, others: dict) -> tuple[np.ndarray, dict]:
        """A snapshot shard this node holds a copy of, as new objects on this node (re-homing)."""
        return param, others

    @ray.method(concurrency_group="ctl")
    def sees_path(self, path: str) -> bool:
        """Whether this worker's node sees directory `path` (a checkpoint on resume)."""
        return os.path.isdir(path)

    def restore_train(self, metas: list[dict], train_ranks: Sequence[int], *arrays: Any) -> dict:
        """Become trainer `self.device` of `train_ranks` with the snapshot state of `metas`.

        `arrays` holds, for each meta in order, its parameter array then its other-kinds dict:
        only the snapshot shards overlapping this rank's new pieces are passed. Collective over
        the new training group (FSDP is set up on it).
        """
        t0 = time.time()
        self.sync_image.reset()  # a restore resets the delta chain: the next sync is full (roles/delta_sync.py)
        ranks = tuple(sorted(int(r) for r in train_ranks))
        if self.engine is not None:
            self.engine.release()
            self.engine = None
        shards = [{"param": arrays[2 * i], **arrays[2 * i + 1]} for i in range(len(metas))]
        trainer = self._new_trainer(ranks, init=False)
        trainer.load_state(_source(metas, shards, partial=True), metas[0]["scalars"])
        self.trainer, self.train_ranks, self.role = trainer, ranks, "train"
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": trainer.step}

    def restore_rollout(self, version: int, metas: list[dict], *params: np.ndarray, step: int | None = None,
                        fresh: bool = False) -> dict:
        """Become a rollout device holding the weights of `version` (every shard's parameters).
        `step`: a streaming pull for that step (its `weight_sync` fault point); `fresh`: a
        recovery, whose router re-issues every request, so the engine's running ones are dropped."""
        if step is not None:
            self._maybe_fault("weight_sync", step)
        if fresh:
            self.sync_image.reset()  # a restore resets the delta chain (roles/delta_sync.py)
        if fresh and self.engine is not None:
            self._stop(list(self._served()), keep=False)  # through the turn loop too (worker_serve.py)
            self._forget_requests()
        t0 = time.time()
        source = _source(metas, [{"param": p} for p in params], partial=False)
        staged = self._load_engine(lambda lo, hi: source.read("param", lo, hi), version)
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": version, **staged}

    def load_rollout_checkpoint(self, directory: str, version: int) -> dict:
        """Rollout weights of `version` from a params-only checkpoint (resume)."""
        from dynaresize.roles.checkpoint import CheckpointReader

        t0 = time.time()
        reader = CheckpointReader(directory)
        staged = self._load_engine(lambda lo, hi: reader.read("param", lo, hi), version)
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": version, **staged}

    def _load_engine(self, read: Callable[[int, int], torch.Tensor], version: int) -> dict:
        """The engine (started or woken if none) loads the weights `read(lo, hi)` gives as one
        flat vector, bucket by bucket through bounded host staging (pinned on CUDA) in the
        engine's dtype (roles/weight_sync.py `host_weights`), never the whole model at once
        on the device; the fields of its `weight_sync` record."""
        if self.trainer is not None:
            self._drop_trainer()
        if self.engine is None:
            self.engine = self._new_engine()
        wire, staging = self._wire_dtype(), Staging()
        self.engine.set_weights(host_weights(self._model_specs(), read, dtype=wire, staging=staging,
                                             pin=self.torch_device.type == "cuda"), version)
        self._mark_version(version)  # partial rollout: running requests go on under `version` (worker_serve.py)
        self.role = "rollout"
        return staging.record(wire)
