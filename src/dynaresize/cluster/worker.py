"""The long-lived device worker: one Ray actor per device, created once, switching role in place.

A worker joins the run's one torch.distributed world once (`init_world`), owns its
communicator pool, and holds one role runtime at a time: a rollout engine or a trainer shard
(roles/train_fsdp.py: FSDP2 over the cached training communicator). A resize never restarts
the process and never creates a new world: the driver runs the plan's ops by name
(cluster/resize_ops.py), and each op calls one method of the worker (cluster/worker_resize.py).

Device placement: a worker holding a GPU puts everything on `cuda:0` (Ray sets
CUDA_VISIBLE_DEVICES to its own GPU); snapshots and exports copy to host explicitly
(`.cpu()`); leaving a role frees its tensors and empties the CUDA cache.

Threads, and the one-issuing-thread rule: every collective a device takes part in (group
creation, FSDP's collectives, the weight sync, parameter and moment moves) and every CUDA
memory release is issued by one thread, the actor's default thread, in the order the driver
submits them. The driver submits from one place, so each device's calls are a subsequence of
one global order, and every collective is reached by all its members after the same earlier
ones: no cycle of waits, and never two threads issuing NCCL work on one device (NCCL does not
allow it). "Background" work keeps the rule by being ordinary calls the driver does not wait
for: the moment hand-off (cluster/handoff.py) and pre-warming groups are queued on every device
right after a resize's critical ops, ahead of any later stage work, and run as soon as all
their members are there. The communicator pool refuses group creation from any other thread
(`CommPool(issuer=...)`). One other thread exists and issues nothing: `ctl` answers liveness
pings and fires injected faults (cluster/worker_recovery.py, faults.py).

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
from dynaresize.cluster.worker_checkpoint import CheckpointMixin
from dynaresize.cluster.handoff import MomentHandoff
from dynaresize.cluster.pacing import PacedMixin
from dynaresize.cluster.worker_recovery import RecoveryMixin
from dynaresize.cluster.worker_resize import ResizeOpsMixin
from dynaresize.cluster.worker_serve import ServeMixin
from dynaresize.cluster.worker_train import TrainStageMixin
from dynaresize.comm import rendezvous
from dynaresize.comm.pool import CommPool
from dynaresize.config import RunConfig
from dynaresize.config_load import build_config
from dynaresize.errors import ConfigError
from dynaresize.reshard.layout import RowChunkLayout
from dynaresize.rl.env import env_spec
from dynaresize.rl.models import build_model
from dynaresize.roles.base import GenRequest, compute_dtype, engine_dtype, resolve_engine
from dynaresize.roles.delta_sync import Image, resolve_mode, sync_member
from dynaresize.roles.factory import rollout_engine_from_config
from dynaresize.roles.train_fsdp import FSDPTrainer
from dynaresize.roles.train_spec import TrainerSpec
from dynaresize.roles.weight_sync import Staging, drain, receive_weights, send_weights


def local_device(backend: str) -> torch.device:
    """cuda:0 when this worker holds a GPU and the world runs NCCL, else the CPU."""
    if backend in ("nccl", "auto") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


class DeviceWorker(RecoveryMixin, PacedMixin, TrainStageMixin, ResizeOpsMixin, ServeMixin, CheckpointMixin):
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
        self.torch_device = local_device(self.cfg.cluster.backend)
        if self.torch_device.type == "cuda" and not self.cfg.deterministic:  # TF32 for what stays fp32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if resolve_engine(self.cfg) == "vllm":
            # vLLM's imports (seconds) at worker start, off every resize's critical path. On this
            # thread: importing from a second thread raced transformers' lazy module set-up.
            from dynaresize.roles.vllm_process import preload_vllm

            preload_vllm()
        self.spec = TrainerSpec.from_config(self.cfg, cuda=self.torch_device.type == "cuda")
        self.role: str | None = None
        self.pool: CommPool | None = None
        self.trainer: FSDPTrainer | None = None
        self.engine = None
        self._parked = None  # an engine kept warm while this device trains (rollout.engine_release=park)
        self._parked_ranks: tuple[int, ...] = ()  # the replica a parked engine belongs to
        self._replica: tuple[tuple[int, ...], Any] = ((self.device,), None)  # (ranks, TPPlacement or None)
        self.train_ranks: tuple[int, ...] = ()
        self._specs: list | None = None
        self._full: dict[str, torch.Tensor] | None = None  # full weights held for the engine to start with
        self._full_version: int | None = None
        self.sync_image = Image()  # the last weights sent or received (rollout.weight_sync=delta; roles/delta_sync.py)
        self.moments = MomentHandoff()  # the last resize's optimizer moments (cluster/handoff.py)
        self._faults: list[tuple[str, str, int]] = []  # (kind, point, step) armed by the driver

    # ------------------------------------------------------------------ world and groups

    def info(self) -> dict:
        return {"device": self.device, "pid": os.getpid(), "ip": rendezvous.node_ip(), "role": self.role,
                "torch_device": str(self.torch_device)}

    @ray.method(concurrency_group="ctl")
    def rendezvous_port(self) -> int:
        """A free port on this worker's node, answered at once on the ctl thread (a TP
        replica's rendezvous, cluster/replicas.py), whatever the main thread is running."""
        return rendezvous.free_port()

    def free_port(self) -> int:
        return rendezvous.free_port()

    def init_world(self, init_method: str, world_size: int, generation: int = 0) -> dict:
        t0 = time.time()
        rendezvous.init_world(rank=self.device, world_size=world_size, init_method=init_method,
                              backend=self.cfg.cluster.backend, timeout_s=self.cfg.timeouts.collective_s,
                              generation=generation)
        # This thread issues every collective of the device from now on (module docstring).
        self.pool = CommPool(timeout_s=self.cfg.timeouts.collective_s, issuer=threading.get_ident())
        return {"t0": t0, "t1": time.time(), "world_inits": rendezvous.world_inits()}

    def create_groups(self, rank_sets: Sequence[Sequence[int]], critical: bool, tag: str = "") -> dict:
        """Collective over the world: every worker gets the same list in the same order."""
        t0 = time.time()
        flags = [self.pool.create(rs, critical=critical, tag=tag) for rs in rank_sets]
        return {"created": sum(flags), "flags": flags, "t0": t0, "t1": time.time()}

    def prewarm_groups(self, rank_sets: Sequence[Sequence[int]], keep: Sequence | None = None) -> dict:
        """`create_groups` off the critical path: queued right after a resize (module docstring);
        then every group outside `keep` ((tag, ranks) pairs) is destroyed (`CommPool.retain`)."""
        out = self.create_groups(rank_sets, critical=False)
        if keep is not None:
            out["destroyed"] = [[tag, list(rs)] for tag, rs in self.pool.retain(keep)]
        return out

    def comm_stats(self) -> dict:
        return self.pool.stats() if self.pool is not None else {"world_inits": rendezvous.world_inits()}

    # ------------------------------------------------------------------ roles

    def _model_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the trainable parameters in flattening order (tied weights once)."""
        if self._specs is None:  # with train.lora: the adapter's tensors by wire name (roles/lora.py)
            from dynaresize.roles.lora_model import trainable_specs

            self._specs = trainable_specs(self.cfg.model, self.cfg.train.lora)
        return self._specs

    def _layout(self, ranks: Sequence[int]) -> RowChunkLayout:
        return RowChunkLayout.of_shapes([s for _, s in self._model_specs()], ranks)

    def _new_trainer(self, ranks: Sequence[int], init: bool) -> FSDPTrainer:
        from dynaresize.roles.initial_weights import initial_weights  # only this rank's rows (built on meta)

        ranks = tuple(sorted(ranks))
        return FSDPTrainer(self.spec, ranks=ranks, rank=self.device, group=self.pool.get(ranks),
                           device=self.torch_device, init_model=initial_weights(self.cfg.model) if init else None)

    def set_replica(self, ranks: Sequence[int], master_addr: str, master_port: int) -> dict:
        """This device is TP rank `ranks.index(device)` of the rollout replica over `ranks`
        (`rollout.tensor_parallel` > 1; cluster/replicas.py). Queued by the driver before the
        call that starts the replica's engines; the port is new for each replica formed, and an
        engine of another replica (a recovery re-forms them all) is released here."""
        from dynaresize.roles.base import TPPlacement

        ranks = tuple(int(r) for r in ranks)
        tp = TPPlacement(size=len(ranks), rank=ranks.index(self.device), master_addr=str(master_addr),
                         master_port=int(master_port))
        if self.engine is not None and self._replica != (ranks, tp):
            self._forget_requests()
            self.engine.release()
            self.engine = None
        self._replica = (ranks, tp)
        return {"ranks": list(ranks), "tp_rank": tp.rank}

    def _new_engine(self):
        """The rollout engine this device serves with: the parked one woken when there is one
        (one vLLM engine per process) and it belongs to this device's replica, else a new one
        (started by its first `set_weights`; a TP rank's start is collective over its replica)."""
        ranks, tp = getattr(self, "_replica", ((), None))  # (test stand-ins of the worker hold none)
        if self._parked is not None and getattr(self, "_parked_ranks", ranks) != ranks:  # its TP peers are others now
            self._parked.release()
            self._parked = None
        if self._parked is not None:
            engine, self._parked = self._parked, None
            if hasattr(engine, "unpark"):
                engine.unpark()
            return engine
        extra = {"device": self.torch_device} if self._engine_name() == "hf" else {}
        if tp is not None:
            extra["tp"] = tp
        return rollout_engine_from_config(self.cfg, **extra)

    def _engine_name(self) -> str:
        """"vllm" or "hf": `rollout.engine` resolved for this run (roles/base.py)."""
        if getattr(self, "_engine", None) is None:
            self._engine = resolve_engine(self.cfg)
        return self._engine

    def _old_logprobs(self) -> str:
        """Where the PPO ratio's behaviour log-probs come from (`train.old_logprobs`). `auto`:
        the engine's when they are the trainer's own computation (the HF engine in fp32),
        recomputed by the trainers otherwise (vLLM's kernels, bf16 training)."""
        mode = self.cfg.train.old_logprobs
        if mode != "auto":
            return mode
        # exact only where the engine computes as the trainer does: both in fp32 (on CUDA, auto is bf16 for both)
        cuda = getattr(self, "torch_device", torch.device("cpu")).type == "cuda"
        exact = (self._engine_name() == "hf" and compute_dtype(self.cfg, cuda=cuda) == "fp32"
                 and self.cfg.train.lora is None  # an engine serves merged weights; trainers compute base + B(A x)
                 and engine_dtype(self.cfg, cuda=cuda) == "float32")
        return "engine" if exact else "recompute"

    def _drop_trainer(self) -> None:
        """Leave the train role: the worker lets go of its trainer, whose tensors go (its
        `release` drops them, collects the reference cycles FSDP's modules and hooks form,
        and frees the cache: roles/device_memory.py), before anything starts in that memory."""
        trainer, self.trainer, self.train_ranks = self.trainer, None, ()
        if trainer is not None:
            trainer.release()

    def start_train(self, train_ranks: Sequence[int]) -> dict:
        """Initial role: a trainer shard of the freshly initialised model (identical everywhere)."""
        self.trainer = self._new_trainer(train_ranks, init=True)
        self.train_ranks, self.role = tuple(sorted(train_ranks)), "train"
        return {"numel": self.trainer.layout.numel, "state_bytes": self.trainer.state_bytes()}

    def start_rollout(self, version: int) -> dict:
        """Initial role: a rollout engine holding the initial weights (version 0)."""
        self.engine = self._new_engine()
        if self.cfg.train.lora is not None:  # the step-0 adapter (the engine merges it into the base it reads)
            from dynaresize.roles.lora_model import initial_adapter

            self.engine.set_weights(initial_adapter(self._model_specs(), self.cfg.seed), version)
        else:
            self.engine.set_weights(build_model(self.cfg.model).state_dict(), version)
        self.role = "rollout"
        return {"version": version}

    # ------------------------------------------------------------------ stage work

    def generate(self, requests: list[GenRequest], step: int) -> dict:
        self._maybe_fault("rollout", step)
        self._pin_threads()
        t0 = time.time()
        results = self._stepper().generate(requests)  # multi-turn: inside the turn loop (worker_serve.py)
        return {"results": results, "t0": t0, "t1": time.time(), "device": self.device}

    def _pin_threads(self) -> None:
        """torch's thread count is per calling thread under OpenMP: pin it where the math runs."""
        if torch.get_num_threads() != self.cfg.cluster.torch_threads:
            torch.set_num_threads(self.cfg.cluster.torch_threads)

    def sync_weights(self, root: int, sync_ranks: Sequence[int], version: int, step: int) -> dict:
        """Weights of `version` from the trainers to the rollout devices in `sync_ranks`.

        Every trainer takes part (the full weights are gathered parameter by parameter over the
        training group); the root sends them in buckets over the sync group ({root} + rollout
        devices); rollout devices load them into their engines in place."""
        self._maybe_fault("weight_sync", step)
        t0 = time.time()
        specs, wire = self._model_specs(), self._wire_dtype()
        group = self.pool.get(sync_ranks) if self.device in sync_ranks else None
        lora = self.cfg.train.lora is not None  # the adapter goes whole (auto: full; delta refused by the config)
        if not lora and resolve_mode(self.cfg.rollout.weight_sync, wire) == "delta":  # only what changed (delta_sync.py)
            out = sync_member(trainer=self.trainer, engine=self.engine, image=self.sync_image, specs=specs, root=root,
                              group=group, version=version, device=self.torch_device, dtype=wire,
                              is_root=self.device == root)
            return {"t0": t0, "t1": time.time(), "device": self.device, **out}
        if self.trainer is not None:
            sent = send_weights(self.trainer.full_params(), specs, root=root, group=group, dtype=wire,
                                is_root=self.device == root, device=self.torch_device)
            return {"t0": t0, "t1": time.time(), "bytes": sent, "device": self.device}
        staging = Staging()
        stream = receive_weights(specs, root=root, group=group, device=self.torch_device, dtype=wire, staging=staging)
        try:
            self.engine.set_weights(stream, version)  # each bucket loaded before the next is received
        finally:
            left = drain(stream)  # the root sends every bucket: take what a failed load left
        if left:
            raise RuntimeError(f"device {self.device}: the engine left {left} weight buckets of version {version}")
        return {"t0": t0, "t1": time.time(), "bytes": staging.wire_bytes, "device": self.device,
                **staging.record(wire)}

    def _wire_dtype(self) -> torch.dtype:
        """The dtype weights travel in to this run's engines: the engine's own (roles/base.py
        `engine_dtype`, resolved as roles/factory.py does for this device), so a bf16 engine
        gets half the bytes and no cast on arrival. Every device of a run resolves the same."""
        cuda = self.torch_device.type == "cuda" if self._engine_name() == "hf" else None
        return getattr(torch, engine_dtype(self.cfg, cuda=cuda))

    def param_digest(self, cast: str | None = None) -> str:
        """Digest of the full weights (collective over the training group); `cast`: of the
        weights cast to that dtype first (what an engine of that dtype must hold)."""
        if cast is None:
            return self.trainer.digest()
        from dynaresize.roles.weight_sync import weights_digest

        return weights_digest((n, t.to(getattr(torch, cast))) for n, t in self.trainer.full_params())

    def engine_digest(self) -> str:
        """Digest of the weights the rollout engine serves (compared with the trainers')."""
        return self.engine.weights_digest([n for n, _ in self._model_specs()])

    def trainer_scalars(self) -> dict:
        return self.trainer.scalars()

    # ------------------------------------------------------------------ outputs

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 weights on the host (collective over the training group; every trainer
        calls it, the first returns them)."""
        full = {n: t.cpu() for n, t in self.trainer.full_params()}
        return full if self.trainer.index == 0 else None

    def load_checkpoint(self, directory: str, train_ranks: Sequence[int]) -> dict:
        self.sync_image.reset()  # a resume resets the delta chain (roles/delta_sync.py)
        if self.engine is not None:
            self._forget_requests()
            self.engine.release()
            self.engine = None
        self.trainer = self._new_trainer(train_ranks, init=False)
        info = self.trainer.load_checkpoint(directory)
        self.train_ranks, self.role = tuple(sorted(train_ranks)), "train"
        return info

    # ------------------------------------------------------------------ faults

    def arm_fault(self, kind: str | None, point: str | None = None, step: int | None = None) -> None:
        """Add a fault to fire at (point, step); `kind` None disarms all (cluster/faults.py)."""
        self._faults = [] if kind is None else [*self._faults, (kind, point, step)]

    def _maybe_fault(self, point: str, step: int) -> None:
        for kind, p, s in self._faults:
            if p == point and s == step:
                fire(kind)  # kill: the process dies mid-work; stop: the whole process freezes

    def ping(self) -> int:
        return self.device

    @ray.method(concurrency_group="ctl")
    def abort_comms(self) -> bool:
        """Abort every communicator of this device's world from the ctl thread, while the
        issuing thread may be blocked in a collective with a lost peer (NCCL's abort is meant for
        another thread; comm/rendezvous.py). Sent on the first loss, before the survivors settle.
        Skipped (False) while the issuing thread has an in-process vLLM engine's world swapped in
        (roles/vllm_world.py): the abort would hit vLLM's groups; `reset_world` aborts ours then."""
        from dynaresize.roles.vllm_world import DIST_SWAP_LOCK

        if not DIST_SWAP_LOCK.acquire(blocking=False):
            return False
        try:
            return rendezvous.abort_world()
        finally:
            DIST_SWAP_LOCK.release()


def worker_config(cfg: RunConfig) -> dict:
    """The config dict a device worker is built from: the run's, with `rollout.engine = auto`
    resolved once on the driver (it looks at the host), so every device runs the same engine.
    Refuses `rollout.tensor_parallel` > 1 where it cannot run: a multi-turn task, or an engine
    other than vllm (ConfigError)."""
    from dynaresize.config_load import config_to_dict

    k = cfg.rollout.tensor_parallel
    if k > 1 and env_spec(cfg.task):
        raise ConfigError([f"rollout.tensor_parallel={k}: must be 1 with a multi-turn task (task {cfg.task.name}): "
                           "a TP replica's ranks run in lockstep, environment calls do not"])
    out = config_to_dict(cfg)
    out["rollout"]["engine"] = resolve_engine(cfg)
    if k > 1 and out["rollout"]["engine"] != "vllm":
        raise ConfigError([f"rollout.tensor_parallel={k}: needs the vllm engine (rollout.engine={cfg.rollout.engine} "
                           f"runs {out['rollout']['engine']} here, which serves a replica on one device only)"])
    env = cfg.task.env
    if env and env.rsplit(":", 1)[0].endswith(".py"):  # a file: as the driver sees it, whatever the worker's cwd
        out["task"]["env"] = f"{os.path.abspath(env.rsplit(':', 1)[0])}:{env.rsplit(':', 1)[1]}"
    return out


def remote_worker_class():
    """The Ray actor class; `ctl` is the thread for pings and faults (see the module docstring),
    `snap` hands snapshot copies to the object store (cluster/worker_recovery.py)."""
    return ray.remote(concurrency_groups={"ctl": 1, "snap": 1})(DeviceWorker)
