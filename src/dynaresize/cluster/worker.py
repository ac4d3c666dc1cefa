"""The long-lived device worker: one Ray actor per device, created once, switching role in place.

A worker joins the run's one torch.distributed world once (`init_world`), owns its
communicator pool, and holds one role runtime at a time: a rollout engine or a trainer shard.
A resize never restarts the process and never creates a new world: it moves trainer state
(`reshard_params`, `reshard_moments`), switches the role (`leave_train`, `release_engine`,
`gather_params`) and reuses cached groups.

Threads: Ray runs the default methods one at a time on the main thread; methods in the `bg`
concurrency group run on one background thread. The background thread does only what may
overlap the step's real work: pre-warming groups and moving optimizer moments on the
`background` group (never a group the main thread uses: two threads must not share a group).
`train` waits for pending moments only just before the optimizer step, so their movement
overlaps forward and backward (DESIGN.md section 6). A third thread, `ctl`, only answers
liveness pings and fires injected faults (cluster/worker_recovery.py, cluster/faults.py).

Every method that does timed work returns epoch start/end times (`time.time()`), which the
driver turns into `span` and `op` records.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import ray
import torch

from dynaresize.cluster.faults import fire
from dynaresize.cluster.worker_recovery import RecoveryMixin
from dynaresize.comm import rendezvous
from dynaresize.comm.pool import CommPool
from dynaresize.config import RunConfig, build_config
from dynaresize.reshard.execute import ReshardStats, reshard_flat
from dynaresize.rl import grpo
from dynaresize.rl.models import build_model
from dynaresize.roles.base import GenRequest, build_rollout_engine
from dynaresize.roles.train_state import OptimSettings
from dynaresize.roles.train_torch import ShardedTrainer
from dynaresize.roles.weight_sync import broadcast_flat, flatten_params, param_specs, unflatten

PARAM_KINDS = ("param",)
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
BACKGROUND_TAG = "background"


class DeviceWorker(RecoveryMixin):
    """The actor body (wrapped by `ray.remote` in `remote_worker_class`)."""

    def __init__(self, device: int, config: dict) -> None:
        self.cfg: RunConfig = build_config(config)
        self.device = int(device)
        torch.set_num_threads(self.cfg.cluster.torch_threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass
        if self.cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.role: str | None = None
        self.pool: CommPool | None = None
        self.trainer: ShardedTrainer | None = None
        self.engine = None
        self.train_ranks: tuple[int, ...] = ()
        self._numel: int | None = None
        self._specs: list | None = None
        self._old_moments: dict[str, torch.Tensor] | None = None
        self._moments_done = threading.Event()
        self._moments_done.set()
        self._moments_error: BaseException | None = None
        self._faults: list[tuple[str, str, int]] = []  # (kind, point, step) armed by the driver
        self._handover: torch.nn.Module | None = None  # engine model kept for a joining trainer
        self._handover_version: int | None = None  # the weights version that model holds

    # ------------------------------------------------------------------ world and groups

    def info(self) -> dict:
        return {"device": self.device, "pid": os.getpid(), "ip": rendezvous.node_ip(), "role": self.role}

    def free_port(self) -> int:
        return rendezvous.free_port()

    def init_world(self, init_method: str, world_size: int, generation: int = 0) -> dict:
        t0 = time.time()
        rendezvous.init_world(rank=self.device, world_size=world_size, init_method=init_method,
                              backend=self.cfg.cluster.backend, timeout_s=self.cfg.timeouts.collective_s,
                              generation=generation)
        self.pool = CommPool(timeout_s=self.cfg.timeouts.collective_s)
        return {"t0": t0, "t1": time.time(), "world_inits": rendezvous.world_inits()}

    def create_groups(self, rank_sets: Sequence[Sequence[int]], critical: bool, tag: str = "") -> dict:
        """Collective over the world: every worker gets the same list in the same order."""
        t0 = time.time()
        flags = [self.pool.create(rs, critical=critical, tag=tag) for rs in rank_sets]
        return {"created": sum(flags), "flags": flags, "t0": t0, "t1": time.time()}

    @ray.method(concurrency_group="bg")
    def prewarm_groups(self, rank_sets: Sequence[Sequence[int]]) -> dict:
        """`create_groups` off the critical path, on the background thread."""
        return self.create_groups(rank_sets, critical=False)

    def comm_stats(self) -> dict:
        return self.pool.stats() if self.pool is not None else {"world_inits": rendezvous.world_inits()}

    # ------------------------------------------------------------------ roles

    def _model_specs(self) -> list:
        if self._specs is None:
            self._specs = param_specs(build_model(self.cfg.model))
        return self._specs

    def _new_trainer(self, model: torch.nn.Module, ranks: Sequence[int]) -> ShardedTrainer:
        settings = OptimSettings.from_config(self.cfg.train)
        return ShardedTrainer(model, settings, ranks=ranks, rank=self.device, seed=self.cfg.seed)

    def start_train(self, train_ranks: Sequence[int]) -> dict:
        """Initial role: a trainer shard of the freshly initialised model (identical everywhere)."""
        settings = OptimSettings.from_config(self.cfg.train)
        model = build_model(self.cfg.model).train()
        self.trainer = ShardedTrainer.build_from_model(model, train_ranks, self.device, settings, seed=self.cfg.seed)
        self.train_ranks, self.role, self._numel = tuple(sorted(train_ranks)), "train", self.trainer.numel
        return {"numel": self.trainer.numel, "shard_bytes": self.trainer.shard_bytes()}

    def start_rollout(self, version: int) -> dict:
        """Initial role: a rollout engine holding the initial weights (version 0)."""
        self.engine = build_rollout_engine(self.cfg.rollout.backend, self.cfg.model, self.cfg.rollout.temperature,
                                           batch_rows=self.cfg.rollout.batch_rows)
        self.engine.set_weights(build_model(self.cfg.model).state_dict(), version)
        self.role = "rollout"
        return {"version": version}

    # ------------------------------------------------------------------ stage work

    def generate(self, requests: list[GenRequest], step: int) -> dict:
        self._maybe_fault("rollout", step)
        self._pin_threads()
        t0 = time.time()
        results = self.engine.generate(requests)
        return {"results": results, "t0": t0, "t1": time.time(), "device": self.device}

    def _pin_threads(self) -> None:
        """torch's thread count is per calling thread under OpenMP: pin it where the math runs."""
        if torch.get_num_threads() != self.cfg.cluster.torch_threads:
            torch.set_num_threads(self.cfg.cluster.torch_threads)

    def train(self, step: int, micro_batches: list[tuple[int, list]], num_micro_batches: int,
              total_tokens: int) -> dict:
        """One training step on this rank's micro-batches (fixed composition by sample index)."""
        self._maybe_fault("train", step)
        self._pin_threads()
        t0 = time.time()
        group = self.pool.get(self.train_ranks) if len(self.train_ranks) > 1 else None
        tc = self.cfg.train
        temperature = self.cfg.rollout.temperature

        def loss_fn(model: torch.nn.Module, mb: list) -> Any:
            loss = grpo.micro_batch_loss(model, mb, total_response_tokens=total_tokens, clip_eps=tc.clip_eps,
                                         kl_coef=0.0, temperature=temperature)
            return loss, sum(len(s.response_ids) for s in mb)

        self.trainer.model.train()
        stats = self.trainer.compute_grads(micro_batches, loss_fn, group=group,
                                           num_micro_batches=num_micro_batches, reduction="sum")
        t_grads = time.time()
        self._moments_done.wait()  # optimizer moments moved in the background must be here now
        if self._moments_error is not None:
            raise self._moments_error
        t_wait = time.time()
        stats.update(self.trainer.apply_optimizer(group=group))
        stats.update(t0=t0, t_grads=t_grads, t_wait=t_wait, t1=time.time(), device=self.device,
                     version=self.trainer.step)
        return stats

    def sync_weights(self, src: int, ranks: Sequence[int], version: int, step: int) -> dict:
        """Broadcast the full weights from trainer `src` to the rollout devices in `ranks`."""
        self._maybe_fault("weight_sync", step)
        t0 = time.time()
        group = self.pool.get(ranks)
        numel = self._numel or sum(int(torch.Size(s).numel()) for _, s in self._model_specs())
        if self.device == src:
            broadcast_flat(flatten_params(self.trainer.model), numel=numel, src=src, group=group)
        else:
            flat = broadcast_flat(None, numel=numel, src=src, group=group)
            self.engine.set_weights(unflatten(flat, self._model_specs()), version)
        return {"t0": t0, "t1": time.time(), "bytes": numel * 4, "device": self.device}

    # ------------------------------------------------------------------ resize ops

    def reshard_params(self, old_ranks: Sequence[int], new_ranks: Sequence[int], *, with_moments: bool,
                       scalars: dict | None, step: int, version: int | None = None) -> dict:
        """Move parameter shards (and the moments too unless they go in the background).

        Called on every device in old_ranks | new_ranks. A joining device builds its trainer
        here around the model its engine handed over; a leaving device keeps its old moment
        shards until `reshard_moments` has sent them.

        With `version` given, every new trainer's model already holds that version's weights in
        fp32 (trainers after their step; a joining device got them by the weight sync), so each
        new parameter shard is cut from the local model and no parameter bytes move at all.
        Without it, parameter shards move through the staging buffer and a joining device
        rebuilds its compute weights by `gather_params`.
        """
        self._maybe_fault("resize.reshard", step)
        t0 = time.time()
        old_ranks, new_ranks = tuple(sorted(old_ranks)), tuple(sorted(new_ranks))
        local = version is not None
        kinds = (() if local else PARAM_KINDS) + (MOMENT_KINDS if with_moments else ())
        old = None
        if self.trainer is not None:
            live = self.trainer.state_shards()
            old = {k: live[k] for k in kinds}
            if not with_moments:
                self._old_moments = {k: live[k] for k in MOMENT_KINDS}
        if self._numel is None:
            self._numel = sum(int(torch.Size(s).numel()) for _, s in self._model_specs())
        new, stats = {}, ReshardStats(bytes_sent=0, bytes_received=0, peak_staging_bytes=0, seconds=0.0,
                                      num_messages=0)
        if kinds:
            new, stats = reshard_flat(old, numel=self._numel, old_ranks=old_ranks, new_ranks=new_ranks,
                                      rank=self.device, staging_bytes=self.cfg.reshard.staging_bytes,
                                      kinds=kinds, dtypes={k: torch.float32 for k in kinds})
        if self.device in new_ranks:
            if self.trainer is None:  # joining: compute with the model the engine handed over
                held = self._handover_version
                model, self._handover = self._handover or build_model(self.cfg.model), None
                self.trainer = self._new_trainer(model.train(), new_ranks)
                self.trainer.load_scalars(scalars)
            else:
                held = self.trainer.step
            if local and held != version:
                raise RuntimeError(f"device {self.device}: its model holds version {held}, not {version}; "
                                   "parameter shards cannot be cut locally")
            self.trainer.load_state_shards(new, new_ranks)
            if local:
                self.trainer.load_params_from_model()
            self.train_ranks, self.role = new_ranks, "train"
        if not with_moments and (self.device in old_ranks or self.device in new_ranks):
            self._moments_done.clear()
        return {"t0": t0, "t1": time.time(), **stats.to_dict()}

    @ray.method(concurrency_group="bg")
    def reshard_moments(self, old_ranks: Sequence[int], new_ranks: Sequence[int], world_ranks: Sequence[int]) -> dict:
        """Background op: move optimizer moments on the background group, overlapping compute."""
        t0 = time.time()
        try:
            group = self.pool.get(world_ranks, tag=BACKGROUND_TAG)
            new, stats = reshard_flat(self._old_moments, numel=self._numel, old_ranks=old_ranks,
                                      new_ranks=new_ranks, rank=self.device,
                                      staging_bytes=self.cfg.reshard.staging_bytes, group=group,
                                      kinds=MOMENT_KINDS, dtypes={k: torch.float32 for k in MOMENT_KINDS})
            if self.device in new_ranks:
                self.trainer.load_state_shards(new)
            self._old_moments = None
            return {"t0": t0, "t1": time.time(), **stats.to_dict()}
        except BaseException as exc:  # surfaced to the main thread at its optimizer step
            self._moments_error = exc
            raise
        finally:
            self._moments_done.set()

    def leave_train(self, version: int, step: int) -> dict:
        """Train -> rollout on this device: free training memory, build the engine with the
        current weights it already holds (no bytes move: the weights are local)."""
        self._maybe_fault("resize.switch", step)
        t0 = time.time()
        model = self.trainer.model
        self.trainer.release()
        self.trainer, self.train_ranks = None, ()
        self.engine = build_rollout_engine(self.cfg.rollout.backend, self.cfg.model, self.cfg.rollout.temperature,
                                           batch_rows=self.cfg.rollout.batch_rows)
        if hasattr(self.engine, "adopt_model"):  # the compute model already holds the current weights
            self.engine.adopt_model(model, version)
        else:
            self.engine.set_weights(model.state_dict(), version)
        self.role = "rollout"
        return {"t0": t0, "t1": time.time()}

    def release_engine(self, step: int) -> dict:
        """Rollout -> train, first op: release the engine (its caches go; its model object is
        kept for the trainer to compute with, so no model is built on the critical path).
        Nothing is in flight at a step boundary, so the drain is empty."""
        self._maybe_fault("resize.switch", step)
        t0 = time.time()
        if self.engine is not None and hasattr(self.engine, "hand_over_model"):
            self._handover_version = self.engine.version
            self._handover = self.engine.hand_over_model()  # the trainer computes with it
        elif self.engine is not None:
            self.engine.release()
        self.engine, self.role = None, "joining"
        return {"t0": t0, "t1": time.time()}

    def gather_params(self) -> dict:
        """Every trainer of the new training group rebuilds its full compute params."""
        t0 = time.time()
        group = self.pool.get(self.train_ranks) if len(self.train_ranks) > 1 else None
        self.trainer.gather_params(group)
        return {"t0": t0, "t1": time.time()}

    def param_digest(self) -> str:
        """sha1 of the full compute parameters' bytes: equal digests mean bit-identical weights."""
        import hashlib

        return hashlib.sha1(flatten_params(self.trainer.model).numpy().tobytes()).hexdigest()

    def trainer_scalars(self) -> dict:
        return self.trainer.scalars()

    # ------------------------------------------------------------------ outputs

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.full_state_dict()

    def save_checkpoint(self, directory: str, extra: dict | None = None) -> dict:
        group = self.pool.get(self.train_ranks) if len(self.train_ranks) > 1 else None
        self.trainer.save_checkpoint(directory, group=group, extra=extra)
        return {"device": self.device}

    def load_checkpoint(self, directory: str, train_ranks: Sequence[int]) -> dict:
        model = build_model(self.cfg.model).train()
        self.trainer = self._new_trainer(model, train_ranks)
        group = self.pool.get(tuple(sorted(train_ranks))) if len(train_ranks) > 1 else None
        info = self.trainer.load_checkpoint(directory, train_ranks, self.device, group=group)
        self.train_ranks, self.role, self._numel = tuple(sorted(train_ranks)), "train", self.trainer.numel
        return info

    # ------------------------------------------------------------------ faults (issue 5)

    def arm_fault(self, kind: str | None, point: str | None = None, step: int | None = None) -> None:
        """Add a fault to fire at (point, step); `kind` None disarms all (cluster/faults.py)."""
        self._faults = [] if kind is None else [*self._faults, (kind, point, step)]

    def _maybe_fault(self, point: str, step: int) -> None:
        for kind, p, s in self._faults:
            if p == point and s == step:
                fire(kind)  # kill: the process dies mid-work; stop: the whole process freezes

    def ping(self) -> int:
        return self.device


def remote_worker_class():
    """The Ray actor class; `bg` is the one background thread (see the module docstring)."""
    return ray.remote(concurrency_groups={"bg": 1, "ctl": 1})(DeviceWorker)
