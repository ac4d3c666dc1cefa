"""In-memory snapshots of trainer state, and restoring survivors from them (driver side).

A `Snapshot` of version v is the trainer state after v optimizer steps, as the trainers held
it: one entry per training rank (its pieces of the layout, the replicated scalars) and object
refs to its arrays (`param`, and the other kinds: optimizer moments, the reference weights).
The arrays are task results owned by the driver and stored in the object store of each
trainer's node (cluster/worker_recovery.py), so they survive the loss of the trainer's
process (not of its node: that is what the on-disk checkpoints are for).

Invariants:
- a snapshot is taken only when every trainer of the step has finished it, and the driver
  notes a step's samples as consumed only after the snapshot of its result exists: restoring
  the latest snapshot never applies a step twice nor loses one (docs/faults.md);
- the shards' pieces tile [0, numel) (checked): any layout can be rebuilt from any other
  (reshard/sources.py), reading only the overlapping ranges, as on load of a checkpoint;
- `write_checkpoint` writes the trainers' checkpoint format (roles/checkpoint.py: shards,
  then the manifest last), so a trainer loads it at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from dynaresize.reshard.sources import check_tiling


def _overlaps(a: list, b: list) -> bool:
    return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)


@dataclass
class Snapshot:
    version: int
    metas: list[dict]  # by rank index: "pieces", "numel", "scalars", "params", "layout", "settings"
    params: list[Any]  # ObjectRef per shard: its `param` pieces, concatenated
    others: list[Any] | None  # ObjectRef per shard: {kind: array} of the other kinds; None: params only

    def __post_init__(self) -> None:
        check_tiling([tuple(p) for m in self.metas for p in m["pieces"]], self.numel,
                     f"snapshot of version {self.version}")

    @property
    def numel(self) -> int:
        return int(self.metas[0]["numel"])

    def train_args(self, pieces: list) -> tuple[list[dict], list[Any]]:
        """(metas, refs) that `restore_train` needs for a rank holding `pieces` (global ranges)
        of the new layout: only the snapshot shards overlapping them, each as its params ref
        then its other-kinds ref."""
        if self.others is None:
            raise ValueError(f"snapshot of version {self.version} holds parameters only")
        metas, refs = [], []
        for m, p, o in zip(self.metas, self.params, self.others):
            if _overlaps(m["pieces"], pieces):
                metas.append(m)
                refs += [p, o]
        return metas, refs


def take(cluster: Any, version: int, train_devices: tuple[int, ...]) -> Snapshot:
    """Snapshot the trainers' state (they must all be at `version`); waits with the watchdog."""
    calls = [cluster.workers[d].snapshot_state.remote(version) for d in train_devices]
    metas = cluster.wait([(d, c[0]) for d, c in zip(train_devices, calls)], f"snapshot {version}")
    return Snapshot(version=version, metas=metas, params=[c[1] for c in calls], others=[c[2] for c in calls])


def params_only(version: int, flat: np.ndarray, meta: dict) -> Snapshot:
    """A parameters-only snapshot put by the driver (rollout weights read from a checkpoint)."""
    flat = np.ascontiguousarray(flat)
    m = {**meta, "pieces": [[0, int(flat.size)]], "numel": int(flat.size)}
    return Snapshot(version=version, metas=[m], params=[ray.put(flat)], others=None)


def restore(cluster: Any, train: Snapshot, rollout: Snapshot) -> list[dict]:
    """Trainers of the cluster's assignment from `train`, rollout devices from `rollout`'s
    parameters (the version their next samples must come from). Returns the workers' timings."""
    from dynaresize.types import ROLLOUT, TRAIN

    a = cluster.assignment
    trainers, rollers = a.devices(TRAIN), a.devices(ROLLOUT)
    new = cluster.layout_for(trainers)  # the trainers' own layout at the new size
    calls = []
    for d in trainers:
        metas, refs = train.train_args([list(p) for p in new.rank_pieces(d)])
        calls.append((d, cluster.workers[d].restore_train.remote(metas, trainers, *refs)))
    for d in rollers:
        calls.append((d, cluster.workers[d].restore_rollout.remote(rollout.version, rollout.metas, *rollout.params)))
    return cluster.wait(calls, "restore")


def load_rollout(cluster: Any, snap: Snapshot) -> list[dict]:
    """Give every rollout device the weights of `snap.version` (before a rollout that needs them)."""
    from dynaresize.types import ROLLOUT

    calls = [(d, cluster.workers[d].restore_rollout.remote(snap.version, snap.metas, *snap.params))
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
    infos = []
    num = len(snap.metas)
    for i, m in enumerate(snap.metas):
        arrays = {"param": ray.get(snap.params[i])}
        if not params_only and snap.others is not None:
            arrays.update(ray.get(snap.others[i]))
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in arrays.items()}
        infos.append(ckpt.save_shard(directory, shard_index=i, num_shards=num, pieces=m["pieces"],
                                     tensors=tensors, step=snap.version))
    m0 = snap.metas[0]
    ckpt.write_manifest(directory, infos=infos, numel=snap.numel, params=m0["params"], ranks=list(range(num)),
                        scalars=m0["scalars"], settings=m0.get("settings", {}), layout=m0.get("layout"),
                        extra={"version": snap.version, **(extra or {})})
    return directory / ckpt.MANIFEST
