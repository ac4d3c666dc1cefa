"""The resize ops on a device worker: one method per op a plan names (cluster/resize_ops.py
HANDLERS calls them by name). A mixin of `cluster.worker.DeviceWorker`: it uses the worker's
communicator pool, trainer, engine, config, fault points and moment threads.

Train -> rollout: `gather_full` (the leaving device gets full current weights), then
`reshard_params` (parameter shards to the remaining trainers, through the bounded staging
buffer), `reshard_moments` (optimizer moments to their new owners, on the background
communicator: in the background on gloo, deferred to the next optimizer step on NCCL, see the
worker's docstring), `free_train_memory`, `load_weights` and `alloc_kv_cache`. Rollout ->
train: `drain_requests`, `release_engine`, then the same reshard ops into the grown group.

Each returns epoch start/end times and the bytes it moved, which the driver turns into `op`
records. A device that holds no part in an op (a rank outside both layouts) returns at once.
"""

from __future__ import annotations

import time
from typing import Sequence

import ray
import torch

from dynaresize.comm import rendezvous
from dynaresize.reshard.execute import NO_STATS
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
            if keeps:  # only a device leaving for rollout keeps a copy (its engine's first weights)
                full[name] = t.cpu() if self.torch_device.type == "cpu" else t
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
        kinds = ("param",) + ((REF_KIND,) if self.spec.with_ref else ())
        old = self.trainer
        new = self._new_trainer(new_ranks, init=False) if self.device in new_ranks else None
        stats = move_state(old, new, kinds=kinds, old_layout=old_layout, new_layout=new_layout, rank=self.device,
                           spec=self.spec, staging_bytes=self.cfg.reshard.staging_bytes, group=None)
        self._old_moments = {k: old.pieces(k) for k in MOMENT_KINDS} if old is not None else None
        self._old_layout = old_layout
        self._moments_done.clear()
        if old is not None:
            old.model = old.ref = None  # parameters go now; moments stay until sent
        self.trainer = new
        if new is not None:
            new.load_scalars(scalars)
            self.train_ranks, self.role = new_ranks, "train"
        else:
            self.train_ranks = ()
        return {"t0": t0, "t1": time.time(), **stats.to_dict()}

    def _move_moments(self, new_ranks: Sequence[int]) -> dict:
        t0 = time.time()
        new_ranks = tuple(sorted(new_ranks))
        group = self.pool.get(tuple(range(rendezvous.live_world().world_size)), tag=BACKGROUND_TAG)
        stats = NO_STATS
        if self._old_moments is not None or self.trainer is not None:
            stats = move_state(None, self.trainer, kinds=MOMENT_KINDS, old_layout=self._old_layout,
                               new_layout=self._layout(new_ranks), rank=self.device, spec=self.spec,
                               staging_bytes=self.cfg.reshard.staging_bytes, group=group,
                               old_pieces=self._old_moments)
        self._old_moments = None
        return {"t0": t0, "t1": time.time(), **stats.to_dict()}

    @ray.method(concurrency_group="bg")
    def reshard_moments(self, new_ranks: Sequence[int], background: bool = True) -> dict:
        """Move optimizer moments on the background group (see the module docstring). With
        NCCL and `background`, the move is left to this worker's main thread: a trainer runs it
        before its next optimizer step (`train`), a device that left training in `flush_moments`,
        which the driver calls beside that training step; so two threads never issue NCCL work
        at once. Without `background` the driver is waiting and no main-thread work runs: it
        moves now."""
        if background and self.torch_device.type == "cuda":
            self._inline_moments = lambda: self._run_moments(new_ranks)
            return {"t0": time.time(), "t1": time.time(), "deferred": True}
        return self._run_moments(new_ranks)

    def flush_moments(self) -> dict:
        """NCCL: a device that left training sends its deferred moment shards (main thread)."""
        t0 = time.time()
        self._run_deferred_moments()
        return {"t0": t0, "t1": time.time()}

    def _run_deferred_moments(self) -> None:
        if self._inline_moments is not None:
            move, self._inline_moments = self._inline_moments, None
            move()

    def _run_moments(self, new_ranks: Sequence[int]) -> dict:
        try:
            return self._move_moments(new_ranks)
        except BaseException as exc:  # surfaced to the main thread at its optimizer step
            self._moments_error = exc
            raise
        finally:
            self._moments_done.set()

    @ray.method(concurrency_group="bg")
    def free_train_memory(self) -> dict:
        """Background op after the moments left: drop what training held on a leaving device."""
        t0 = time.time()
        self._moments_done.wait()
        self._old_moments = None
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()
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

    def drain_requests(self) -> dict:
        """Rollout -> train: returns once every generate call sent to this worker has ended
        (methods run one at a time on the main thread, so this call queues behind them)."""
        t0 = time.time()
        return {"t0": t0, "t1": time.time()}

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
            self._parked = self.engine
        elif self.engine is not None:
            self.engine.release()
        self.engine, self.role = None, "joining"
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        return {"t0": t0, "t1": time.time(), "memory_freed": freed}
