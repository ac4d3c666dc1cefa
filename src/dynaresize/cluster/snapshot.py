"""In-memory snapshots of trainer state, and restoring survivors from them (driver side).

A `Snapshot` of version v is the trainer state after v optimizer steps, as the trainers held
it: one entry per training rank (its pieces of the layout, the replicated scalars) and object
refs to its arrays (`param`, and the other kinds: optimizer moments, the reference weights;
`others` is None for a parameters-only snapshot). The arrays are task results owned by the
driver and stored in the object store of each trainer's node (cluster/worker_recovery.py), so
they survive the loss of the trainer's process; the driver process never holds them. Which
versions are full, and taking them off the step's path, is driver/snapshots.py's; `take` here
is the blocking full snapshot (start, resume, after a replay, a checkpoint on demand). To
survive the loss of the whole node (its object store goes with it), a full snapshot is
replicated off-node (`replicate`): a worker on another node (`replica_holders`) pins a copy in
its node's object store (`hold_replica`), and Ray, which knows both copies, reads the surviving
one (when the primary's node dies, the owner makes the copy the primary). On a single node
there is nowhere to replicate to, and nothing to replicate for.

Invariants:
- a snapshot is taken only when every trainer of the step has finished it; the driver keeps the
  scored samples of every step since the latest full snapshot, so restoring it and replaying
  them never applies a step twice nor loses one (docs/faults.md);
- the shards' pieces tile [0, numel) (checked): any layout can be rebuilt from any other
  (reshard/sources.py), reading only the overlapping ranges, as on load of a checkpoint;
- a full snapshot whose shards have holders (`replicas`) counts only once every replica is
  pinned: the base of a replay survives the loss of any one node;
- holders keep the replicas of the last `KEEP_VERSIONS` versions (the driver keeps fewer full ones);
- `write_checkpoint` writes the trainers' checkpoint format (roles/checkpoint.py: shards,
  then the manifest last), so a trainer loads it at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray

from dynaresize.reshard.sources import check_tiling


KEEP_VERSIONS = 3  # the driver keeps versions k-1..k+1 (runtime._prune): holders keep as many


def _overlaps(a: list, b: list) -> bool:
    return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)


@dataclass
class Snapshot:
    version: int
    metas: list[dict]  # by rank index: "pieces", "numel", "scalars", "params", "layout", "settings"
    params: list[Any]  # ObjectRef per shard: its `param` pieces, concatenated
    others: list[Any] | None  # ObjectRef per shard: {kind: array} of the other kinds; None: params only
    replicas: dict[int, int] | None = None  # shard index -> device id holding a copy on another node
    nodes: list[str] | None = None  # shard index -> Ray node id of its primary copy (multi-node runs)

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
    """Snapshot the trainers' state (they must all be at `version`), replicated off-node where
    the cluster spans several nodes; waits with the watchdog."""
    calls = [cluster.workers[d].snapshot_state.remote(version) for d in train_devices]
    metas = cluster.wait([(d, c[0]) for d, c in zip(train_devices, calls)], f"snapshot {version}")
    snap = Snapshot(version=version, metas=metas, params=[c[1] for c in calls], others=[c[2] for c in calls])
    replicate(cluster, snap, train_devices)
    return snap


def replica_holders(train_ranks: Sequence[int], node_of_rank: Sequence[str]) -> dict[int, int]:
    """For each training rank, the rank that holds a copy of its shard: the first rank after it
    (cyclically) on another node. A rank whose node hosts every rank gets none."""
    n = len(node_of_rank)
    out = {}
    for d in train_ranks:
        other = [(d + j) % n for j in range(1, n) if node_of_rank[(d + j) % n] != node_of_rank[d]]
        if other:
            out[d] = other[0]
    return out


def replicate(cluster: Any, snap: Snapshot, train_devices: Sequence[int]) -> None:
    """Pin a copy of every shard of `snap` on another node (see the module docstring)."""
    if not getattr(cluster, "nodes", None):
        return
    holders = replica_holders(train_devices, [cluster.node_of(r) for r in range(cluster.num_devices)])
    calls = [(h, cluster.workers[h].hold_replica.remote(snap.version, snap.version - KEEP_VERSIONS + 1, i,
                                                          snap.params[i], snap.others[i]))
             for i, d in enumerate(train_devices) if (h := holders.get(d)) is not None]
    snap.nodes = [cluster.node_of(d) for d in train_devices]
    if calls:
        cluster.wait(calls, f"replicate snapshot {snap.version}")
        snap.replicas = {i: cluster.ids[holders[d]] for i, d in enumerate(train_devices) if d in holders}


def rehome(cluster: Any, snapshots: dict[int, Snapshot], down: set[str]) -> int:
    """After the loss of the nodes `down`: every shard with a copy there (its primary, or its
    replica) becomes a new object, copied by a live worker on the node of its live copy, so
    nothing later (a restore, a checkpoint) tries to read the dead copy and waits for Ray to
    find out that it is gone (measured: a read of an object with a dead copy on the list stalled
    ~10 s). Returns how many shards were re-made."""
    if not down:
        return 0
    calls, moved = [], []
    for snap in snapshots.values():
        if not snap.nodes or snap.others is None:
            continue
        for i, primary in enumerate(snap.nodes):
            holder = (snap.replicas or {}).get(i)
            copies = [primary] + ([cluster.nodes[holder]] if holder is not None else [])
            live = [n for n in copies if n not in down]
            if len(live) == len(copies) or not live:
                continue  # untouched; or lost with both copies: the restore fails (docs/cluster.md, limits)
            rank = next((r for r in range(cluster.num_devices) if cluster.node_of(r) == live[0]), None)
            if rank is None:
                continue
            param, others = cluster.workers[rank].copy_shard.remote(snap.params[i], snap.others[i])
            calls.append((rank, param))
            moved.append((snap, i, param, others, live[0]))
    cluster.wait(calls, "re-home snapshots")
    for snap, i, param, others, node in moved:
        snap.params[i], snap.others[i], snap.nodes[i] = param, others, node
        if snap.replicas:
            snap.replicas.pop(i, None)
    return len(moved)


def params_only(version: int, flat: np.ndarray, meta: dict) -> Snapshot:
    """A parameters-only snapshot put by the driver (rollout weights read from a checkpoint)."""
    flat = np.ascontiguousarray(flat)
    m = {**meta, "pieces": [[0, int(flat.size)]], "numel": int(flat.size)}
    return Snapshot(version=version, metas=[m], params=[ray.put(flat)], others=None)


def restore(cluster: Any, train: Snapshot) -> list[dict]:
    """Trainers of the cluster's assignment from `train` (each reading only the shards that
    overlap its pieces of the new layout); the rollout devices' replicas are placed anew, their
    weights come next (`load_rollout`, fresh). Returns the workers' timings."""
    from dynaresize.types import ROLLOUT, TRAIN

    a = cluster.assignment
    trainers, rollers = a.devices(TRAIN), a.devices(ROLLOUT)
    new = cluster.layout_for(trainers)  # the trainers' own layout at the new size
    cluster.place_replicas(rollers)  # every replica is new after a recovery (cluster/replicas.py)
    calls = []
    for d in trainers:
        metas, refs = train.train_args([list(p) for p in new.rank_pieces(d)])
        calls.append((d, cluster.workers[d].restore_train.remote(metas, trainers, *refs)))
    return cluster.wait(calls, "restore")


def load_rollout(cluster: Any, snap: Snapshot, *, fresh: bool = False) -> list[dict]:
    """Give every rollout device the weights of `snap.version` (before a rollout that needs them;
    `fresh`: after a recovery, the engines' running requests are dropped: the router re-issues them)."""
    from dynaresize.types import ROLLOUT

    calls = [(d, cluster.workers[d].restore_rollout.remote(snap.version, snap.metas, *snap.params, fresh=fresh))
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
