"""Checkpoints written by the workers (cluster/checkpoint_io.py, cluster/worker_checkpoint.py).

Stand-in trainers run the real worker method (`CheckpointMixin.save_checkpoint_shard`) into a
temporary directory; the driver side only writes the index. The checkpoint reads back exactly
(roles/checkpoint.py `CheckpointReader`) and the driver never fetched an array (`ray.get` is
refused while it writes). A directory a trainer's node does not see is written by the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dynaresize.cluster import checkpoint_io, snapshot
from dynaresize.cluster.worker_checkpoint import CheckpointMixin
from dynaresize.reshard.layout import FlatLayout
from dynaresize.roles.checkpoint import CheckpointReader

NUMEL = 10


@dataclass(frozen=True)
class Optim:
    lr: float = 0.1
    betas: tuple = (0.9, 0.99)


def _trainer(index: int, ranks: tuple[int, ...], full: dict[str, torch.Tensor], step: int):
    layout = FlatLayout(NUMEL, ranks)
    lo, hi = layout.shard_range(ranks[index])
    return SimpleNamespace(
        index=index, step=step, layout=layout, spec=SimpleNamespace(optim=Optim()),
        local_pieces=lambda: ((lo, hi),), export_state=lambda: {k: v[lo:hi].clone() for k, v in full.items()},
        scalars=lambda: {"step": step, "lr_step": step, "seed": 1, "rng_state": b"\x01\x02"},
        param_meta=lambda: [{"name": "w", "shape": [NUMEL], "offset": 0}])


class Worker(CheckpointMixin):
    def __init__(self, device: int, trainer, sees: bool) -> None:
        self.device, self.trainer, self.sees = device, trainer, sees


def _remote(worker: Worker, name: str):
    """`handle.name.remote(*a)` runs the worker's method at once (the stand-in's wait returns it)."""
    fn = (lambda path: worker.sees) if name == "sees_path" else getattr(worker, name)
    return SimpleNamespace(remote=fn)


def _cluster(tmp_sees: bool, full: dict[str, torch.Tensor], step: int = 3):
    ranks = (1, 2)
    workers = {d: Worker(d, _trainer(i, ranks, full, step), tmp_sees) for i, d in enumerate(ranks)}
    handles = {d: SimpleNamespace(**{n: _remote(w, n) for n in ("sees_path", "save_checkpoint_shard")})
               for d, w in workers.items()}
    return SimpleNamespace(assignment=SimpleNamespace(devices=lambda role: list(ranks)), workers=handles,
                           wait=lambda calls, where, deadline_s=None: [ref for _, ref in calls])


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(NUMEL, generator=g) for k in ("param", "exp_avg", "exp_avg_sq")}


def test_trainers_write_their_shards_and_the_driver_only_the_index(tmp_path):
    full = _full()

    def no_get(*a, **kw):
        raise AssertionError("the driver fetched checkpoint bytes")

    with mock.patch.object(snapshot.ray, "get", no_get):
        out = checkpoint_io.write_trainer_checkpoint(_cluster(True, full), tmp_path / "trainer", version=3)
    assert out["written_by"] == "trainers" and out["bytes"] > 0
    reader = CheckpointReader(tmp_path / "trainer")
    assert reader.manifest["step"] == 3 and len(reader.manifest["shards"]) == 2
    for k, v in full.items():
        assert torch.equal(reader.read(k, 0, NUMEL), v)


def test_a_trainer_holding_another_version_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="version 4 asked"):
        checkpoint_io.write_trainer_checkpoint(_cluster(True, _full()), tmp_path / "t", version=4)


def test_a_directory_a_trainer_does_not_see_is_written_by_the_driver(tmp_path):
    taken = []

    def take(cluster, version, ranks):
        taken.append((version, list(ranks)))
        return "snap"

    with mock.patch.object(snapshot, "take", take), \
            mock.patch.object(snapshot, "write_checkpoint", lambda snap, d, extra=None: taken.append(snap)):
        out = checkpoint_io.write_trainer_checkpoint(_cluster(False, _full()), tmp_path / "t", version=3)
    assert out["written_by"] == "driver" and taken == [(3, [1, 2]), "snap"]
