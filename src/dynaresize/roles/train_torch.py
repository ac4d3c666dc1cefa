"""The training role on one rank: a flat sharding of trainer state (ZeRO/FSDP-like), whose
results do not depend on how many training devices share the work.

Layout: the trainable parameters of the model, in `model.named_parameters()` order (a tied
weight appears once), form one flat fp32 vector of `numel` elements. Training rank i of the
sorted rank tuple owns the balanced contiguous range `shard_range(numel, W, i)`; that rule must
stay equal to `reshard.layout.FlatLayout(numel, ranks)`. Persistent state is sharded: each rank
holds its slice of the fp32 master parameters and of the AdamW moments `exp_avg` and
`exp_avg_sq`; the scalars (optimizer step, LR-schedule step, seed, RNG state) are replicated.
Compute parameters are materialised in full inside the model (like FSDP without
reshard-after-forward) and rebuilt from the shards by an all-gather after every optimizer step.

One step, split so that optimizer-state movement can overlap forward/backward:
- `compute_grads`: forward/backward of the micro-batches this rank was given (index-seeded
  RNG), each flat gradient added into an fp64 buffer, then one all_reduce(SUM) of that buffer
  (which also carries the loss sum, token count and micro-batch count). Never touches moments.
- `apply_optimizer`: this rank's slice of the summed gradient (scaled, optionally clipped by
  the fp64 global norm) is cast to fp32 and fed to an elementwise AdamW on the local shards;
  then the parameter shards are all-gathered into the model.

Why results do not depend on W (DESIGN 3 and 8b): a micro-batch's gradient depends only on
the micro-batch and the (replicated) weights; a sum of fp32 values in fp64 is exact unless
their exponents span more than ~29 bits, and even then its fp64 rounding survives the cast back
to fp32 only when it crosses an fp32 rounding boundary (not seen in the tests: results are
bitwise equal for W = 1..4); AdamW is elementwise, each element computed by the same op
sequence wherever its shard boundary falls. DDP's fp32 ring reduction breaks exactly the middle
step, and Adam magnifies the difference.

Not trainer state: frozen parameters (`requires_grad=False`) and buffers stay as the model was
built. Known departure from torch.optim.AdamW: a trainable parameter that receives no gradient
in a step is updated with a zero gradient (decay still applies) instead of being skipped.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dynaresize.errors import CheckpointError
from dynaresize.roles import checkpoint as ckpt
from dynaresize.roles.train_state import OptimSettings, adamw_update_, mix_seed, shard_range

__all__ = ["ShardedTrainer", "OptimSettings", "adamw_update_", "shard_range", "STATE_KEYS"]

STATE_KEYS = ckpt.STATE_KEYS
LossFn = Callable[[nn.Module, Any], Any]  # -> loss tensor, or (loss, num_tokens)
_STATS = 3  # extra fp64 slots after the gradient: loss sum, tokens, micro-batches seen


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


class ShardedTrainer:
    """Trainer state of one training rank. See the module docstring for layout and invariants."""

    def __init__(self, model: nn.Module, settings: OptimSettings | None = None, *,
                 ranks: Sequence[int] = (0,), rank: int = 0, seed: int = 0) -> None:
        self.model = model
        self.settings = settings or OptimSettings()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._offsets: list[int] = []
        total = 0
        for p in self._params:
            self._offsets.append(total)
            total += p.numel()
        self.numel = total
        self.device = self._params[0].device
        self.seed = int(seed)
        self.step = 0  # optimizer steps applied
        self.lr_step = 0  # schedule position
        self.generator = torch.Generator().manual_seed(self.seed)  # for callers; state is checkpointed
        self._shards: dict[str, torch.Tensor] = {}
        self._pending: set[str] = set(STATE_KEYS)
        self._grad_buf: torch.Tensor | None = None
        self._grad_ready = False
        self._grad_coef = 1.0
        self._last_group: Any = None
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._set_layout(ranks, rank)

    # ------------------------------------------------------------------ layout and state

    @classmethod
    def build_from_model(cls, model: nn.Module, ranks: Sequence[int], rank: int,
                         settings: OptimSettings | None = None, *, seed: int = 0) -> "ShardedTrainer":
        """Shards from the model's current parameters, zero moments, step counters at 0."""
        trainer = cls(model, settings, ranks=ranks, rank=rank, seed=seed)
        lo, hi = trainer.shard_range()
        zeros = lambda: torch.zeros(hi - lo, dtype=torch.float32, device=trainer.device)  # noqa: E731
        trainer.load_state_shards({"param": trainer._read_model_range(lo, hi), "exp_avg": zeros(),
                                   "exp_avg_sq": zeros()})
        return trainer

    def _set_layout(self, ranks: Sequence[int], rank: int) -> bool:
        ordered = tuple(sorted(int(r) for r in ranks))
        if len(set(ordered)) != len(ordered) or rank not in ordered:
            raise ValueError(f"rank {rank} not in training ranks {ordered} (or duplicates)")
        changed = ordered != getattr(self, "ranks", None) or rank != getattr(self, "rank", None)
        self.ranks, self.rank, self.index = ordered, int(rank), ordered.index(rank)
        self._lo, self._hi = shard_range(self.numel, len(ordered), self.index)
        if changed:
            self._gather_bufs = None
        return changed

    def shard_range(self) -> tuple[int, int]:
        return self._lo, self._hi

    @property
    def param_names(self) -> list[str]:
        return list(self._names)

    def param_meta(self) -> list[dict]:
        return [{"name": n, "shape": list(p.shape), "offset": o}
                for n, p, o in zip(self._names, self._params, self._offsets)]

    def state_shards(self) -> dict[str, torch.Tensor]:
        """The live 1-D fp32 shards this rank holds (not copies); pending ones are absent."""
        return {k: self._shards[k] for k in STATE_KEYS if k not in self._pending}

    def pending_state(self) -> set[str]:
        return set(self._pending)

    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_shards().values())

    def load_state_shards(self, shards: Mapping[str, torch.Tensor], ranks: Sequence[int] | None = None,
                          *, rank: int | None = None) -> None:
        """Install shards (after a reshard). With a new rank set, ranges are re-derived and every
        state key not given becomes pending: it must be loaded before `apply_optimizer` (so
        moments may arrive while `compute_grads` runs)."""
        if ranks is not None and self._set_layout(ranks, self.rank if rank is None else rank):
            self._pending = set(STATE_KEYS)
        size = self._hi - self._lo
        for key, t in shards.items():
            if key not in STATE_KEYS:
                raise ValueError(f"unknown state shard {key!r}; expected one of {STATE_KEYS}")
            if t.dim() != 1 or t.numel() != size:
                raise ValueError(f"shard {key} has shape {tuple(t.shape)}, expected ({size},) for range "
                                 f"{self.shard_range()} of ranks {self.ranks}")
            self._shards[key] = t.to(self.device, torch.float32).contiguous()
            self._pending.discard(key)

    def load_params_from_model(self) -> None:
        """Cut this rank's parameter shard from the model's compute parameters: valid when they
        equal the fp32 master (fp32 compute weights of the current version), as after a step's
        all-gather or a weight sync. Moves no bytes between ranks."""
        lo, hi = self.shard_range()
        self.load_state_shards({"param": self._read_model_range(lo, hi)})

    def scalars(self) -> dict:
        return {"step": self.step, "lr_step": self.lr_step, "seed": self.seed,
                "rng_state": bytes(self.generator.get_state().tolist())}

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        self.step, self.lr_step, self.seed = int(scalars["step"]), int(scalars["lr_step"]), int(scalars["seed"])
        state = scalars.get("rng_state")
        if state is not None:
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def _read_model_range(self, lo: int, hi: int) -> torch.Tensor:
        """Flat fp32 values [lo, hi) of the model's trainable parameters."""
        out = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                a, b = max(lo, off), min(hi, off + p.numel())
                if a < b:
                    out[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])
        return out

    def _write_model(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                p.copy_(flat[off:off + p.numel()].view_as(p))

    def full_state_dict(self, *, dedupe_tied: bool = False,
                        device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """The full current weights as an HF-style state dict (copies). Tied keys share one tensor
        as in `model.state_dict()`; `dedupe_tied` keeps only the first key of each (for
        safetensors). Values are the model's compute params (equal to the fp32 master when the
        model is fp32)."""
        out: dict[str, torch.Tensor] = {}
        seen: dict[tuple, torch.Tensor] = {}
        for name, t in self.model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if key in seen and t.numel() > 0:  # empty tensors may all report data_ptr 0
                if not dedupe_tied:
                    out[name] = seen[key]
                continue
            seen[key] = out[name] = t.detach().to(device or t.device, copy=True).contiguous()
        return out

    def release(self) -> None:
        """Free training buffers (gradient and gather) when the device leaves the train role."""
        self._grad_buf = None
        self._gather_bufs = None
        self._grad_ready = False

    # ------------------------------------------------------------------ one step

    @contextmanager
    def _micro_batch_rng(self, index: int) -> Iterator[None]:
        if not self.settings.seed_micro_batches:
            yield
            return
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(mix_seed(self.seed, self.step, index))
            yield

    def compute_grads(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn, *, group: Any,
                      num_micro_batches: int, reduction: str = "mean") -> dict:
        """Forward/backward of this rank's micro-batches and the fp64 all_reduce over `group`
        (None: one process). The applied gradient is the sum over all `num_micro_batches`
        micro-batches, divided by `num_micro_batches` when `reduction` is "mean"."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction {reduction!r}: must be mean or sum")
        if _group_size(group) != len(self.ranks):
            raise ValueError(f"group has {_group_size(group)} ranks, trainer layout has {len(self.ranks)}")
        n = self.numel
        if self._grad_buf is None or self._grad_buf.device != self.device:
            self._grad_buf = torch.zeros(n + _STATS, dtype=torch.float64, device=self.device)
        buf = self._grad_buf
        buf.zero_()
        for p in self._params:
            p.grad = None
        t0 = time.perf_counter()
        for index, micro_batch in micro_batches:
            if not 0 <= index < num_micro_batches:
                raise ValueError(f"micro-batch index {index} outside [0, {num_micro_batches})")
            with self._micro_batch_rng(index):
                out = loss_fn(self.model, micro_batch)
                loss, num_tokens = out if isinstance(out, tuple) else (out, 0)
                loss.backward()
            with torch.no_grad():
                for p, off in zip(self._params, self._offsets):
                    if p.grad is not None:
                        buf[off:off + p.numel()].add_(p.grad.reshape(-1))  # fp32 -> fp64 is exact
                        p.grad = None
                buf[n:n + 1].add_(loss.detach().reshape(1))
                buf[n + 1] += float(num_tokens)
                buf[n + 2] += 1.0
        t1 = time.perf_counter()
        if group is not None and _group_size(group) > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        t2 = time.perf_counter()
        loss_sum, num_tokens_all, seen = (float(v) for v in buf[n:].tolist())
        if int(seen) != num_micro_batches:
            raise RuntimeError(f"{int(seen)} micro-batches computed over the group, expected {num_micro_batches}")
        scale = 1.0 / num_micro_batches if reduction == "mean" else 1.0
        grad_norm = float(torch.linalg.vector_norm(buf[:n]).item()) * scale
        clip = 1.0
        if self.settings.max_grad_norm > 0:
            clip = min(1.0, self.settings.max_grad_norm / (grad_norm + 1e-6))
        self._grad_coef, self._grad_ready, self._last_group = scale * clip, True, group
        return {"loss_sum": loss_sum, "loss_mean": loss_sum / num_micro_batches, "grad_norm": grad_norm,
                "clip_coef": clip, "num_tokens": int(num_tokens_all), "num_micro_batches": num_micro_batches,
                "num_local_micro_batches": len(micro_batches), "fwd_bwd_s": t1 - t0, "reduce_s": t2 - t1}

    def apply_optimizer(self, *, group: Any = "last") -> dict:
        """AdamW on this rank's shards from the reduced gradient, then all-gather the parameter
        shards into the model over `group` (default: the group of the last `compute_grads`)."""
        if not self._grad_ready:
            raise RuntimeError("apply_optimizer called without a reduced gradient (call compute_grads first)")
        if self._pending:
            raise RuntimeError(f"optimizer state not loaded on rank {self.rank}: {sorted(self._pending)}")
        group = self._last_group if isinstance(group, str) and group == "last" else group
        t0 = time.perf_counter()
        lo, hi = self.shard_range()
        grad = self._grad_buf[lo:hi]
        grad = (grad * self._grad_coef if self._grad_coef != 1.0 else grad).to(torch.float32)
        lr = self.settings.lr_at(self.lr_step)
        self.step += 1
        self.lr_step += 1
        beta1, beta2 = self.settings.betas
        adamw_update_(self._shards["param"], self._shards["exp_avg"], self._shards["exp_avg_sq"], grad,
                      step=self.step, lr=lr, beta1=beta1, beta2=beta2, eps=self.settings.eps,
                      weight_decay=self.settings.weight_decay)
        self._grad_ready = False
        t1 = time.perf_counter()
        self.gather_params(group)
        return {"lr": lr, "step": self.step, "optimizer_s": t1 - t0, "gather_s": time.perf_counter() - t1}

    def train_step(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn, *, group: Any,
                   num_micro_batches: int, reduction: str = "mean") -> dict:
        """`compute_grads` then `apply_optimizer`; returns their stats merged, plus `step_s`."""
        t0 = time.perf_counter()
        stats = self.compute_grads(micro_batches, loss_fn, group=group, num_micro_batches=num_micro_batches,
                                   reduction=reduction)
        stats.update(self.apply_optimizer(group=group))
        stats["step_s"] = time.perf_counter() - t0
        return stats

    def gather_params(self, group: Any) -> None:
        """Rebuild the model's full compute params from the parameter shards of every rank."""
        if "param" in self._pending:
            raise RuntimeError(f"parameter shard not loaded on rank {self.rank}")
        num_ranks = len(self.ranks)
        if num_ranks == 1:
            self._write_model(self._shards["param"])
            return
        if _group_size(group) != num_ranks:
            raise ValueError(f"gather needs a group of the {num_ranks} training ranks, got {_group_size(group)}")
        chunk = -(-self.numel // num_ranks)  # uneven shards: gather equal, padded chunks
        if self._gather_bufs is None:
            self._gather_bufs = (torch.zeros(chunk, dtype=torch.float32, device=self.device),
                                 torch.empty(chunk * num_ranks, dtype=torch.float32, device=self.device))
        send, recv = self._gather_bufs
        lo, hi = self.shard_range()
        send[:hi - lo].copy_(self._shards["param"])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(recv, send, group=group)
        if self.numel % num_ranks == 0:
            flat = recv
        else:
            flat = torch.cat([recv[i * chunk:i * chunk + (b - a)]
                              for i, (a, b) in enumerate(shard_range(self.numel, num_ranks, j)
                                                         for j in range(num_ranks))])
        self._write_model(flat)

    # ------------------------------------------------------------------ checkpoints

    def save_shard(self, directory: str | Path) -> dict:
        """Write this rank's shard file atomically; returns its manifest entry."""
        if self._pending:
            raise RuntimeError(f"cannot checkpoint with pending state {sorted(self._pending)}")
        lo, hi = self.shard_range()
        return ckpt.save_shard(directory, shard_index=self.index, num_shards=len(self.ranks), lo=lo, hi=hi,
                               tensors=self.state_shards(), step=self.step)

    def write_manifest(self, directory: str | Path, infos: Sequence[Mapping[str, Any]], *,
                       extra: Mapping[str, Any] | None = None) -> Path:
        """Write the manifest last, from the entries every rank's `save_shard` returned."""
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self.settings).items()}
        return ckpt.write_manifest(directory, infos=infos, numel=self.numel, params=self.param_meta(),
                                   ranks=self.ranks, scalars=self.scalars(), settings=settings, extra=extra)

    def save_checkpoint(self, directory: str | Path, *, group: Any = None,
                        extra: Mapping[str, Any] | None = None) -> None:
        """Collective save: every rank writes its shard, shard 0 writes the manifest last, and no
        rank returns before the checkpoint is complete. `group` None only with one rank."""
        info = self.save_shard(directory)
        num_ranks = len(self.ranks)
        if num_ranks > 1 and _group_size(group) != num_ranks:
            raise ValueError(f"save_checkpoint with {num_ranks} ranks needs their group")
        infos: list[Any] = [info]
        if num_ranks > 1:
            infos = [None] * num_ranks
            dist.all_gather_object(infos, info, group=group)
        if self.index == 0:
            self.write_manifest(directory, infos, extra=extra)
        if num_ranks > 1:
            dist.barrier(group=group)

    def load_checkpoint(self, directory: str | Path, ranks: Sequence[int], rank: int | None = None, *,
                        group: Any = None, verify: bool = True) -> dict:
        """Load a checkpoint saved at any rank count onto `ranks` (reshard on load); rebuild the
        model's compute params (all-gather over `group`, or read them from disk without one).
        Returns the manifest. Raises `CheckpointError` on a missing/partial/corrupt checkpoint."""
        reader = ckpt.CheckpointReader(directory, verify=verify)
        manifest = reader.manifest
        if manifest["numel"] != self.numel or [(p["name"], p["shape"]) for p in manifest["params"]] != \
                [(p["name"], p["shape"]) for p in self.param_meta()]:
            raise CheckpointError(f"checkpoint {directory}: saved for another model "
                                  f"(numel {manifest['numel']}, this model {self.numel})")
        try:
            scalars = ckpt.decode_scalars(manifest["scalars"])
            int(scalars["step"]), int(scalars["lr_step"]), int(scalars["seed"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint {directory}: malformed scalars in manifest") from None
        ordered, rank = sorted(int(r) for r in ranks), self.rank if rank is None else int(rank)
        if rank not in ordered or len(set(ordered)) != len(ordered):
            raise ValueError(f"rank {rank} not in training ranks {tuple(ordered)} (or duplicates)")
        lo, hi = shard_range(self.numel, len(ordered), ordered.index(rank))
        # Read everything before touching this trainer, so a bad checkpoint leaves it as it was.
        shards = {key: reader.read(key, lo, hi).to(self.device) for key in STATE_KEYS}
        self._set_layout(ordered, rank)
        self._pending = set(STATE_KEYS)
        self.load_state_shards(shards)
        self.load_scalars(scalars)
        self._grad_ready = False
        if len(self.ranks) == 1 or group is not None:
            self.gather_params(group)
        else:
            self._write_model(reader.read("param", 0, self.numel).to(self.device))
        return manifest
