"""Device-worker methods for liveness, faults, snapshots and recovery (mixed into DeviceWorker).

Threads (see cluster/worker.py): `ctl` is a third, always-free thread for liveness pings and
injected faults, so a worker busy computing still answers "alive", and a worker that answers
nothing is stuck as a whole. `settle` (main thread) and `settle_bg` (background thread) return
only once every earlier call on that thread has ended: the driver's proof that a survivor is
no longer inside a collective of the lost world.

Snapshots: after each training step every trainer returns its state shards as task results
(`snapshot_state`, three returns: a small meta dict, the fp32 parameter shard, the moments).
Ray keeps results owned by the driver in the object store of the trainer's node, so they
outlive the trainer process: survivors restore from them (`restore_train`, reading only the
ranges they own in the new layout; `restore_rollout`, the full weights of a given version).

Recovery: `reset_world` leaves the old world (destroying it frees every group of it), clears
the communicator pool (counts kept), takes the new rank and joins the new generation on a
fresh port (a fresh TCP store, so no key of the old world can be seen). The trainer is
dropped: trainer state always comes back from a snapshot, never from a half-finished step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import numpy as np
import ray
import torch

from dynaresize.cluster.faults import fire
from dynaresize.comm import rendezvous
from dynaresize.rl.models import build_model
from dynaresize.roles.base import build_rollout_engine
from dynaresize.roles.train_state import OptimSettings
from dynaresize.roles.train_torch import STATE_KEYS, ShardedTrainer
from dynaresize.roles.weight_sync import unflatten

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _writable(a: np.ndarray) -> torch.Tensor:
    """A torch tensor of a (possibly read-only, object-store backed) array: copied."""
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


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

    @ray.method(concurrency_group="bg")
    def settle_bg(self) -> int:
        return self.device

    # ------------------------------------------------------------------ new world generation

    def reset_world(self, init_method: str, rank: int, world_size: int, generation: int) -> dict:
        t0 = time.time()
        rendezvous.destroy_world()
        if self.pool is not None:
            self.pool.clear()
        self.device = int(rank)
        if self.trainer is not None:
            self.trainer.release()
        self.trainer, self.train_ranks = None, ()
        self._old_moments, self._moments_error = None, None
        self._moments_done.set()
        self._handover, self._handover_version = None, None  # a resize cut short left it
        t1 = time.time()
        rendezvous.init_world(rank=self.device, world_size=world_size, init_method=init_method,
                              backend=self.cfg.cluster.backend, timeout_s=self.cfg.timeouts.collective_s,
                              generation=generation)
        return {"t0": t0, "t_destroyed": t1, "t1": time.time(), "world_inits": rendezvous.world_inits()}

    # ------------------------------------------------------------------ snapshots

    @ray.method(num_returns=3)
    def snapshot_state(self, version: int) -> tuple[dict, np.ndarray, dict]:
        tr = self.trainer
        if tr.step != version:
            raise RuntimeError(f"snapshot of version {version} asked, trainer on device {self.device} is at {tr.step}")
        shards = tr.state_shards()
        lo, hi = tr.shard_range()
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(tr.settings).items()}
        meta = {"version": version, "lo": lo, "hi": hi, "index": tr.index, "num_shards": len(tr.ranks),
                "numel": tr.numel, "scalars": tr.scalars(), "params": tr.param_meta(), "settings": settings}
        moments = {k: shards[k].detach().clone().numpy() for k in MOMENT_KEYS}
        return meta, shards["param"].detach().clone().numpy(), moments

    def restore_train(self, metas: list[dict], train_ranks: Sequence[int], *arrays: Any) -> dict:
        """Become trainer `self.device` of `train_ranks` with the snapshot state of `metas`.

        `arrays` holds, for each meta in order, its parameter array then its moments dict: only
        the snapshot shards overlapping this rank's new range are passed. Collective over the
        new training group (the compute parameters are all-gathered from the new shards).
        """
        t0 = time.time()
        ranks = tuple(sorted(int(r) for r in train_ranks))
        if self.engine is not None:
            self.engine.release()
            self.engine = None
        settings = OptimSettings.from_config(self.cfg.train)
        trainer = ShardedTrainer(build_model(self.cfg.model).train(), settings, ranks=ranks, rank=self.device,
                                 seed=self.cfg.seed)
        lo, hi = trainer.shard_range()
        out = {k: torch.empty(hi - lo, dtype=torch.float32) for k in STATE_KEYS}
        covered = 0
        for i, meta in enumerate(metas):
            a, b = max(lo, meta["lo"]), min(hi, meta["hi"])
            if a >= b:
                continue
            pieces = {"param": arrays[2 * i], **arrays[2 * i + 1]}
            for key in STATE_KEYS:
                out[key][a - lo:b - lo].copy_(_writable(pieces[key][a - meta["lo"]:b - meta["lo"]]))
            covered += b - a
        if covered != hi - lo:
            raise RuntimeError(f"snapshot covers {covered} of the {hi - lo} elements of device {self.device}")
        trainer.load_state_shards(out)
        trainer.load_scalars(metas[0]["scalars"])
        group = self.pool.get(ranks) if len(ranks) > 1 else None
        trainer.gather_params(group)
        self.trainer, self.train_ranks, self.role, self._numel = trainer, ranks, "train", trainer.numel
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": trainer.step}

    def restore_rollout(self, version: int, *params: np.ndarray) -> dict:
        """Become a rollout device holding the weights of `version` (parameter shards in order)."""
        t0 = time.time()
        flat = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.float32) for p in params]))
        self._load_engine(flat, version)
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": version}

    def load_rollout_checkpoint(self, directory: str, version: int) -> dict:
        """Rollout weights of `version` from a params-only checkpoint (resume)."""
        from dynaresize.roles.checkpoint import CheckpointReader

        t0 = time.time()
        reader = CheckpointReader(directory)
        self._load_engine(reader.read("param", 0, reader.manifest["numel"]), version)
        return {"t0": t0, "t1": time.time(), "device": self.device, "version": version}

    def _load_engine(self, flat: torch.Tensor, version: int) -> None:
        if self.trainer is not None:
            self.trainer.release()
            self.trainer, self.train_ranks = None, ()
        if self.engine is None:
            self.engine = build_rollout_engine(self.cfg.rollout.backend, self.cfg.model, self.cfg.rollout.temperature,
                                               batch_rows=self.cfg.rollout.batch_rows)
        self.engine.set_weights(unflatten(flat, self._model_specs()), version)
        self.role = "rollout"
