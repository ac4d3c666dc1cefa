"""Checkpoints and the HF export written by the workers, not through the driver (driver side).

A 7B model's trainer state is ~91 GB: read into the driver from the object store and written
from there, every save would cost that much driver memory and one host's bandwidth. Here the
bytes go from each worker straight to the checkpoint directory (cluster/worker_checkpoint.py):
- `write_trainer_checkpoint`: every trainer writes its own shard of the live state (FSDP's
  local pieces), in parallel; the driver then writes the index (`manifest.json`, last, after
  checking every shard file is in place: roles/checkpoint.py);
- `write_snapshot_checkpoint`: a snapshot's shards (rollout weights of an older version, or
  the trainer state when the trainers that held it are gone) are handed by reference to live
  workers, which write them; the driver writes the index;
- `export_hf`: the full weights gathered on the first trainer, which writes the HF folder.

Where: the directory must be one every writer's node sees (`checkpoint.dir` on a shared
filesystem; on one node any local path). Each writer is asked first (`sees_path`); when one
does not see it, the driver writes that checkpoint itself as before (`written_by: "driver"`)
rather than leave shards on a disk the driver cannot index. The format is the same either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaresize.types import TRAIN


def _all_see(cluster: Any, ranks: list[int], directory: Path) -> bool:
    seen = cluster.wait([(r, cluster.workers[r].sees_path.remote(str(directory))) for r in ranks],
                        "checkpoint: directory visible")
    return all(seen)


def write_trainer_checkpoint(cluster: Any, directory: str | Path, *, version: int,
                             extra: dict | None = None) -> dict:
    """The trainers' live state of `version` as a checkpoint in `directory` (shards written by
    each trainer, index by the driver); {"written_by", "bytes"}. Falls back to a snapshot
    written by the driver when a trainer does not see `directory`."""
    from dynaresize.roles import checkpoint as ckpt

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    trainers = list(cluster.assignment.devices(TRAIN))
    if not _all_see(cluster, trainers, directory):
        from dynaresize.cluster import snapshot

        snap = snapshot.take(cluster, version, trainers)
        snapshot.write_checkpoint(snap, directory, extra=extra)
        return {"written_by": "driver", "bytes": dir_bytes(directory)}
    out = cluster.wait([(d, cluster.workers[d].save_checkpoint_shard.remote(str(directory), version, len(trainers)))
                        for d in trainers], "checkpoint: trainer shards")
    m0 = min(out, key=lambda o: o["info"]["index"])
    ckpt.write_manifest(directory, infos=[o["info"] for o in out], numel=m0["numel"], params=m0["params"],
                        ranks=list(range(len(trainers))), scalars=m0["scalars"], settings=m0["settings"],
                        layout=m0["layout"], extra={"version": version, **(extra or {})})
    return {"written_by": "trainers", "bytes": dir_bytes(directory)}


def write_snapshot_checkpoint(cluster: Any, snap: Any, directory: str | Path, *, params_only: bool = False,
                              extra: dict | None = None) -> dict:
    """`snap` (a cluster/snapshot.py Snapshot) as a checkpoint in `directory`: shard i written by
    a live worker (the i-th trainer, round robin) that resolves its arrays by reference; the
    driver writes the index. Falls back to the driver when a writer does not see `directory`."""
    from dynaresize.cluster import snapshot
    from dynaresize.roles import checkpoint as ckpt

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    writers = list(cluster.assignment.devices(TRAIN)) or list(range(cluster.num_devices))
    num = len(snap.metas)
    chosen = [writers[i % len(writers)] for i in range(num)]
    if not _all_see(cluster, sorted(set(chosen)), directory):
        snapshot.write_checkpoint(snap, directory, extra=extra, params_only=params_only)
        return {"written_by": "driver", "bytes": dir_bytes(directory)}
    others = [None] * num if params_only or snap.others is None else snap.others
    infos = cluster.wait([(w, cluster.workers[w].write_snapshot_shard.remote(
        str(directory), i, num, m["pieces"], snap.version, snap.params[i], others[i]))
        for i, (w, m) in enumerate(zip(chosen, snap.metas))], "checkpoint: snapshot shards")
    m0 = snap.metas[0]
    ckpt.write_manifest(directory, infos=infos, numel=snap.numel, params=m0["params"], ranks=list(range(num)),
                        scalars=m0["scalars"], settings=m0.get("settings", {}), layout=m0.get("layout"),
                        extra={"version": snap.version, **(extra or {})})
    return {"written_by": "workers", "bytes": dir_bytes(directory)}


def export_hf(cluster: Any, directory: str | Path) -> str:
    """The current full weights as an HF folder (config.json, model.safetensors) in `directory`,
    written by the first trainer; "trainer", or "driver" when that trainer does not see it."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    trainers = list(cluster.assignment.devices(TRAIN))
    if not _all_see(cluster, trainers[:1], directory):
        from dynaresize.roles.lora_model import save_export

        state = cluster.on_trainers("full_weights", where="export")
        save_export(cluster.cfg.model, cluster.cfg.train.lora, state, directory)  # LoRA: merged, and the adapter
        return "driver"
    cluster.wait([(d, cluster.workers[d].export_hf.remote(str(directory))) for d in trainers], "export")
    return "trainer"


def dir_bytes(directory: Path) -> int:
    """Bytes of every file under `directory` (a checkpoint's size)."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
