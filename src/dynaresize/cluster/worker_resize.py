"""The resize ops on a device worker: one method per op a plan names (cluster/resize_ops.py
HANDLERS calls them by name). A mixin of `cluster.worker.DeviceWorker`: it uses the worker's
communicator pool, trainer, engine, config, fault points and moment hand-off.

Train -> rollout: `gather_full` (the leaving device gets full current weights, on the host),
then `reshard_params` (parameter shards to the remaining trainers, through the bounded staging
buffer; the moments are armed for later: cluster/handoff.py), `reshard_moments` (optimizer
moments to their new owners, on the background communicator), `free_train_memory`,
`load_weights` and `alloc_kv_cache`. Rollout -> train: `migrate_requests`, `release_engine`,
then the same reshard ops into the grown group.

Every op runs on the worker's issuing thread (cluster/worker.py): "background" ops are the
ones the driver does not wait for, not ones on another thread.

Each returns epoch start/end times and the bytes it moved, which the driver turns into `op`
records. A device that holds no part in an op (a rank outside both layouts) returns at once.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from dynaresize.comm import rendezvous
from dynaresize.reshard.execute import NO_STATS
from dynaresize.roles.device_memory import release_device_memory
from dynaresize.roles.train_reshard import move_state
from dynaresize.roles.train_spec import MOMENT_KINDS, REF_KIND

BACKGROUND_TAG = "background"  # the communicator over all devices that optimizer moments move on


class ResizeOpsMixin:
    """The resize-op methods of `DeviceWorker` (see the module docstring)."""

    def gather_full(self, old_ranks: Sequence[int], keep: Sequence[int], version: int, step: int) -> dict:
        """Every trainer of `old_ranks` gathers the full weights; the devices in `keep` (those
        leaving for rollout) hold them for their engine (part of `move_param_shards`)."""
        self._maybe_fault("resize.reshard", step)
        t0 = time.time()
        keeps = self.device in keep
        if keeps and self.trainer.step != version:
            raise RuntimeError(f"device {self.device} holds version {self.trainer.step}, not {version}")
        full = {}
        for name, t in self.trainer.full_params():  # collective: every old trainer walks it all
            if keeps:  # only a device leaving for rollout keeps a copy (its engine's first weights),
                full[name] = t.cpu()  # on the host: the device must be free when the engine starts
        if keeps:
            self._full, self._full_version = full, version
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        return {"t0": t0, "t1": time.time(), "bytes_received": nbytes}

    def reshard_params(self, old_ranks: Sequence[int], new_ranks: Sequence[int], *, scalars: dict,
                       step: int) -> dict:
        """Move parameter shards (and the reference weights) from the old training layout to
        the new one, through the bounded staging buffer, point to point on the world group.
        Called on every device of old_ranks | new_ranks. A device of the new group builds its
        new trainer (FSDP over the new group's cached communicator) and receives straight into
        it; a device keeps its old moment shards until `reshard_moments` has sent them."""
        self._maybe_fault("resize.reshard", step)
        t0 = time.time()
        old_ranks, new_ranks = tuple(sorted(old_ranks)), tuple(sorted(new_ranks))
        old_layout, new_layout = self._layout(old_ranks), self._layout(new_ranks)
        kinds = ("param",) + ((REF_KIND,) if self.spec.holds_ref else ())
        old = self.trainer
        new = self._new_trainer(new_ranks, init=False) if self.device in new_ranks else None
        stats = move_state(old, new, kinds=kinds, old_layout=old_layout, new_layout=new_layout, rank=self.device,
                           spec=self.spec, staging_bytes=self.cfg.reshard.staging_bytes, group=None)
        self.moments.arm({k: old.pieces(k) for k in MOMENT_KINDS} if old is not None else None, old_layout, new_ranks)
        if old is not None:  # parameters go now (collected by `free_train_memory`); moments stay until sent
            old.model = old.ref = None
            old.params = []
        del old
        self.trainer = new
        if new is not None:
            new.load_scalars(scalars)
            self.train_ranks, self.role = new_ranks, "train"
        else:
            self.train_ranks = ()
        return {"t0": t0, "t1": time.time(), **stats.to_dict()}

    def reshard_moments(self, new_ranks: Sequence[int]) -> dict:
        """Move the optimizer moments armed by `reshard_params` to the layout over `new_ranks`,
        on the background communicator, on this worker's issuing thread (cluster/handoff.py).
        The driver queues this on every device of the resize before any later work, so it runs
        as soon as they are all here: off the resize's critical path unless the plan says
        otherwise (`reshard.background_moments = false` waits for it there)."""
        t0 = time.time()
        stats = self.moments.run(self._move_moments) or NO_STATS.to_dict()
        return {"t0": t0, "t1": time.time(), **stats}

    def _move_moments(self, handoff) -> dict:
        group = self.pool.get(tuple(range(rendezvous.live_world().world_size)), tag=BACKGROUND_TAG)
        stats = NO_STATS
        if handoff.old_pieces is not None or self.trainer is not None:
            stats = move_state(None, self.trainer, kinds=MOMENT_KINDS, old_layout=handoff.old_layout,
                               new_layout=self._layout(handoff.new_ranks), rank=self.device, spec=self.spec,
                               staging_bytes=self.cfg.reshard.staging_bytes, group=group,
                               old_pieces=handoff.old_pieces)
        return stats.to_dict()

    def free_train_memory(self) -> dict:
        """After the moments left: return what training held on a leaving device to the device
        (its old shards were dropped when they were sent; the old model's reference cycles are
        collected here, before the engine starts: roles/device_memory.py). CUDA: synchronize
        first, so no kernel of this device is in flight when the cache is emptied."""
        t0 = time.time()
        self.moments.require_done()
        release_device_memory(self.torch_device)
        return {"t0": t0, "t1": time.time()}

    def load_weights(self, version: int, step: int) -> dict:
        """Train -> rollout: the engine starts (or wakes) with the full weights gathered during
        `move_param_shards`; the training role is gone."""
        self._maybe_fault("resize.switch", step)
        t0 = time.time()
        if self._full is None or self._full_version != version:
            raise RuntimeError(f"device {self.device}: no full weights of version {version} to load")
        state, self._full = self._full, None
        woke = self._parked is not None
        self.engine = self._new_engine()
        self.engine.set_weights(state, version)  # in place when woken, else a start
        self.role = "rollout"
        return {"t0": t0, "t1": time.time(), "woke": woke}

    def alloc_kv_cache(self) -> dict:
        """Train -> rollout: the engine's KV cache (what the engine reserves ahead, if anything)."""
        t0 = time.time()
        nbytes = self.engine.alloc_kv_cache() if hasattr(self.engine, "alloc_kv_cache") else 0
        return {"t0": t0, "t1": time.time(), "bytes_received": 0, "kv_cache_bytes": nbytes}

    def migrate_requests(self) -> dict:
        """Rollout -> train at a step boundary (one-step-off): no request is in flight, which
        this call (queued behind every earlier call on the main thread) proves: the engine's
        unfinished requests are counted, and must be 0."""
        t0 = time.time()
        held = len(self._served())
        if held:
            raise RuntimeError(f"device {self.device}: {held} requests in flight at a one-step-off boundary")
        return {"t0": t0, "t1": time.time(), "requests_moved": 0}

    def release_engine(self, step: int) -> dict:
        """Rollout -> train: release the engine's memory (nothing is in flight at a step
        boundary: the driver drained it)."""
        self._maybe_fault("resize.switch", step)
        t0 = time.time()
        freed = True
        if self.engine is not None and self.cfg.rollout.engine_release == "park":
            # Kept warm for the next move to rollout; where the engine cannot free memory while
            # parked (vLLM on CPU, the HF engine) its memory stays in use.
            freed = bool(self.engine.park()) if hasattr(self.engine, "park") else False
            self._parked, self._parked_ranks = self.engine, getattr(self, "_replica", ((), None))[0]
        elif self.engine is not None:
            self.engine.release()
        self._forget_requests()  # the router moved them first (migrate_requests)
        self.engine, self.role = None, "joining"
        release_device_memory(self.torch_device)
        return {"t0": t0, "t1": time.time(), "memory_freed": freed}
