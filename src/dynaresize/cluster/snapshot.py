"""In-memory snapshots of trainer state, and restoring survivors from them (driver side).

A `Snapshot` of version v is the trainer state after v optimizer steps, as the trainers held
it: one entry per training shard (its flat range, the replicated scalars) and object refs to
its arrays. The arrays are task results owned by the driver and stored in the object store of
each trainer's node (cluster/worker_recovery.py), so they survive the loss of the trainer's
process (not of its node: that is what the on-disk checkpoints are for).

Invariants:
- a snapshot is taken only when every trainer of the step has finished it, and the driver
  notes a step's samples as consumed only after the snapshot of its result exists: restoring
  the latest snapshot never applies a step twice nor loses one (docs/faults.md);
- shards tile [0, numel) (checked): any layout can be rebuilt from any other, as on load
  of a checkpoint, reading only the overlapping ranges;
- `write_checkpoint` writes the trainers' checkpoint format (roles/checkpoint.py: shards,
  then the manifest last), so `ShardedTrainer.load_checkpoint` loads it at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from dynaresize.roles.train_state import shard_range


@dataclass
class Snapshot:
    version: int
    metas: list[dict]  # sorted by lo; "lo", "hi", "numel", "scalars", "params", "settings"
    params: list[Any]  # ObjectRef per shard: fp32 array of [lo, hi)
    moments: list[Any] | None  # ObjectRef per shard: {"exp_avg", "exp_avg_sq"}; None: params only

    def __post_init__(self) -> None:
        order = sorted(range(len(self.metas)), key=lambda i: self.metas[i]["lo"])
        self.metas = [self.metas[i] for i in order]
        self.params = [self.params[i] for i in order]
        if self.moments is not None:
            self.moments = [self.moments[i] for i in order]
        pos = 0
        for m in self.metas:
            if m["lo"] != pos:
                raise ValueError(f"snapshot of version {self.version}: shards do not tile at {pos}")
            pos = m["hi"]
        if pos != self.numel:
            raise ValueError(f"snapshot of version {self.version}: shards end at {pos}, numel {self.numel}")

    @property
    def numel(self) -> int:
        return int(self.metas[0]["numel"])

    def train_args(self, num_ranks: int, index: int) -> tuple[list[dict], list[Any]]:
        """(metas, refs) that `restore_train` needs for shard `index` of `num_ranks`: only the
        snapshot shards overlapping its range, each as its params ref then its moments ref."""
        if self.moments is None:
            raise ValueError(f"snapshot of version {self.version} holds parameters only")
        lo, hi = shard_range(self.numel, num_ranks, index)
        metas, refs = [], []
        for m, p, mo in zip(self.metas, self.params, self.moments):
            if m["lo"] < hi and lo < m["hi"]:
                metas.append(m)
                refs += [p, mo]
        return metas, refs


def take(cluster: Any, version: int, train_devices: tuple[int, ...]) -> Snapshot:
    """Snapshot the trainers' state (they must all be at `version`); waits with the watchdog."""
    calls = [cluster.workers[d].snapshot_state.remote(version) for d in train_devices]
    metas = cluster.wait([(d, c[0]) for d, c in zip(train_devices, calls)], f"snapshot {version}")
    return Snapshot(version=version, metas=metas, params=[c[1] for c in calls], moments=[c[2] for c in calls])


def params_only(version: int, flat: np.ndarray, meta: dict) -> Snapshot:
    """A parameters-only snapshot put by the driver (rollout weights read from a checkpoint)."""
    flat = np.ascontiguousarray(flat, dtype=np.float32)
    m = {**meta, "lo": 0, "hi": int(flat.size), "numel": int(flat.size)}
    return Snapshot(version=version, metas=[m], params=[ray.put(flat)], moments=None)


def restore(cluster: Any, train: Snapshot, rollout: Snapshot) -> list[dict]:
    """Trainers of the cluster's assignment from `train`, rollout devices from `rollout`'s
    parameters (the version their next samples must come from). Returns the workers' timings."""
    from dynaresize.types import ROLLOUT, TRAIN

    a = cluster.assignment
    trainers, rollers = a.devices(TRAIN), a.devices(ROLLOUT)
    calls = []
    for i, d in enumerate(trainers):
        metas, refs = train.train_args(len(trainers), i)
        calls.append((d, cluster.workers[d].restore_train.remote(metas, trainers, *refs)))
    for d in rollers:
        calls.append((d, cluster.workers[d].restore_rollout.remote(rollout.version, *rollout.params)))
    return cluster.wait(calls, "restore")


def load_rollout(cluster: Any, snap: Snapshot) -> list[dict]:
    """Give every rollout device the weights of `snap.version` (before a rollout that needs them)."""
    from dynaresize.types import ROLLOUT

    calls = [(d, cluster.workers[d].restore_rollout.remote(snap.version, *snap.params))
             for d in cluster.assignment.devices(ROLLOUT)]
    return cluster.wait(calls, f"rollout weights {snap.version}")


def write_checkpoint(snap: Snapshot, directory: str | Path, *, extra: dict | None = None,
                     params_only: bool = False) -> Path:
    """Write `snap` as a trainer checkpoint (shards, then the manifest last) into `directory`.

    The driver reads the arrays from the object store and writes them: fine for the models a
    driver host can hold; a per-node writer is the way for larger ones (docs/faults.md).
    """
    import torch

    from dynaresize.roles import checkpoint as ckpt

    directory = Path(directory)
    keys = ("param",) if params_only or snap.moments is None else ckpt.STATE_KEYS
    infos = []
    num = len(snap.metas)
    for i, m in enumerate(snap.metas):
        arrays = {"param": ray.get(snap.params[i])}
        if "exp_avg" in keys:
            arrays.update(ray.get(snap.moments[i]))
        tensors = {k: torch.from_numpy(np.array(arrays[k], dtype=np.float32, copy=True)) for k in keys}
        infos.append(ckpt.save_shard(directory, shard_index=i, num_shards=num, lo=m["lo"], hi=m["hi"],
                                     tensors=tensors, step=snap.version))
    m0 = snap.metas[0]
    ckpt.write_manifest(directory, infos=infos, numel=snap.numel, params=m0["params"], ranks=list(range(num)),
                        scalars=m0["scalars"], settings=m0["settings"], extra={"version": snap.version, **(extra or {})})
    return directory / ckpt.MANIFEST
