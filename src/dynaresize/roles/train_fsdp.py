"""The training role on one rank: trainer state sharded by torch FSDP2 (`fully_shard`, DTensor).

Sharding: every decoder block (the model's `_no_split_modules`) and then the root are wrapped
with `fully_shard` on a device mesh made from the run's cached training communicator, so each
trainable parameter is a DTensor sharded on dim 0 (`reshard.layout.RowChunkLayout`): a rank
holds `ceil(rows / W)` rows of each parameter, and the bytes of parameters, gradients and
AdamW moments it holds fall as 1/W. Compute parameters are all-gathered per block for forward
and backward and freed after (FSDP's own schedule). The moments are this class's own tensors,
one per local parameter shard, updated by the elementwise AdamW of `train_state`.

Precision (`TrainerSpec`): master weights, gradients, moments and reductions fp32; compute in
`compute_dtype` (fp32 or bf16, FSDP's MixedPrecisionPolicy). Deterministic mode keeps master
weights, gradients, moments and the gradient reduction in fp64 (compute stays fp32), which is
what makes a step's result independent of W (below); it doubles the state's bytes.

One step (`compute_grads`, then `apply_optimizer`, split so that optimizer moments may arrive
in the background while forward and backward run): micro-batch i of M goes to rank position
i mod W; the step runs ceil(M / W) rounds, each rank doing one micro-batch per round (a rank
without one runs a zero-weighted dummy through the same modules, so every collective of FSDP
matches); each round's backward reduce-scatters the gradient as a SUM (divide factor 1).

Why a deterministic step does not depend on W: a micro-batch's fp32 gradient depends only on
the micro-batch and the weights; FSDP casts it to fp64 before the reduce-scatter and
accumulates the sharded gradient in fp64, where a sum of fp32 values is exact unless their
exponents span more than ~29 bits, so every grouping of the same M terms gives the same value;
the global norm is rounded to fp32 before it scales the gradient; AdamW is elementwise. Tested
bitwise for W = 1, 2, 3, 4 (tests/dist/test_trainer.py).

Checkpoint and reshard view: the state of kind k (`param`, `exp_avg`, `exp_avg_sq`, and `ref`
when a frozen reference model is held) is the list of this rank's local shards, flattened
(`pieces(k)`, live views), laid out as `layout`.

The frozen reference policy (KL) is a second FSDP module built the same way (no gradients).

LoRA (`spec.lora`, roles/lora_model.py): the module is peft's wrap of the policy; the base
weights sit in the same FSDP units, frozen, filled from the initial weights whenever a trainer
is built (never moved); `params`, `names` (wire names), every state kind and the digest cover
the adapter only, so a reshard, a snapshot and a checkpoint carry the adapter and its moments.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dynaresize.reshard.layout import RowChunkLayout
from dynaresize.roles import lora_model
from dynaresize.roles.initial_weights import InitialWeights, fill_shards
from dynaresize.roles.device_memory import release_device_memory
from dynaresize.roles.train_spec import DTYPES, MOMENT_KINDS, REF_KIND, TrainerSpec, empty_model
from dynaresize.roles.train_state import adamw_update_, mix_seed

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Mapping[str, float]]]
_STAT_NAMES = ("loss_sum", "num_tokens", "entropy_sum", "kl_sum", "clipped_tokens", "micro_batches")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped one FSDP unit each: the classes HF names as not to be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class FSDPTrainer:
    """Trainer state of one training rank (see the module docstring)."""

    def __init__(self, spec: TrainerSpec, *, ranks: Sequence[int], rank: int, group: Any,
                 device: torch.device | str = "cpu", init_model: nn.Module | InitialWeights | None = None) -> None:
        """`init_model`: the initial weights, as `InitialWeights` (the module is built on meta,
        sharded, and only this rank's rows are materialised and filled: `fill_shards`) or as
        a full model (every trainer passes the same; sharded from it); None: the state is left
        uninitialised, to be filled by `pieces` (a reshard or restore)."""
        self.spec = spec
        self.ranks = tuple(sorted(int(r) for r in ranks))
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} not in training ranks {self.ranks}")
        self.rank, self.index = int(rank), self.ranks.index(rank)
        self.group = group
        self.device = torch.device(device)
        self.step = 0  # optimizer steps applied
        self.lr_step = 0  # schedule position
        self.generator = torch.Generator().manual_seed(spec.seed)  # replicated; checkpointed
        rows = init_model if isinstance(init_model, InitialWeights) else None
        full = None if rows is not None else init_model
        if spec.lora is not None:  # base rows always (never moved), adapter rows only at init
            rows, full = lora_model.trainer_rows(spec, init_model), None
        ref_init = None
        if spec.holds_ref and full is not None:
            import copy

            ref_init = copy.deepcopy(full)
        self.model = self._shard(full, trainable=True)
        self.ref = self._shard(ref_init, trainable=False) if spec.holds_ref else None
        if rows is not None:  # only this rank's rows, read or initialised (roles/initial_weights.py)
            fill_shards([self.model] + ([self.ref] if self.ref is not None else []), rows, self.index, len(self.ranks))
        named = [(n, p) for n, p in self.model.named_parameters() if spec.lora is None or p.requires_grad]
        self.names = [n if spec.lora is None else lora_model.wire_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.layout = RowChunkLayout.of_shapes([tuple(p.shape) for p in self.params], self.ranks)
        dt = spec.master_dtype
        # A trainer filled by a reshard or restore gets its moments written over: allocating
        # without zeroing keeps building it (on a resize's critical path) cheap.
        alloc = torch.zeros_like if init_model is not None else torch.empty_like
        self.moments = {k: [alloc(p.to_local(), dtype=dt) for p in self.params] for k in MOMENT_KINDS}
        self.pending: set[str] = set() if init_model is not None else set(spec.kinds())
        self._grad_coef: float | None = None
        self.last_state_bytes = self.state_bytes()

    # ------------------------------------------------------------------ construction

    def _shard(self, full: nn.Module | None, *, trainable: bool) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        spec = self.spec
        model = full if full is not None else empty_model(spec.model)
        if spec.lora is not None and trainable:
            model = lora_model.wrap(model, spec.lora)
        dtype = spec.master_dtype if trainable else torch.float32
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        for n, p in model.named_parameters():  # a tied weight is one Parameter: cast once, stays tied
            p.data = p.data.to(dtype)
            p.requires_grad_(trainable and (spec.lora is None or lora_model.wire_name(n) is not None))
        if trainable and spec.activation_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[spec.compute_dtype],
                                      reduce_dtype=torch.float64 if spec.deterministic else torch.float32)
        mesh = DeviceMesh.from_group(self.group, device_type=self.device.type)
        for block in _blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if full is None:
            model.to_empty(device=self.device)
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    buf.copy_(buffers[name])
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # a SUM: the loss already divides by the step's tokens
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        return model.train(trainable)

    # ------------------------------------------------------------------ state view

    def pieces(self, kind: str) -> list[torch.Tensor]:
        """This rank's flattened local shards of `kind` (live views), one per parameter."""
        if kind == "param":
            return [p.to_local().detach().view(-1) for p in self.params]
        if kind in MOMENT_KINDS:
            return [t.view(-1) for t in self.moments[kind]]
        if kind == REF_KIND and self.ref is not None:
            return [p.to_local().detach().view(-1) for p in self.ref.parameters()]
        raise ValueError(f"unknown state kind {kind!r}; this trainer holds {self.spec.kinds()}")

    def mark_loaded(self, kinds: Sequence[str]) -> None:
        """The caller filled `pieces(k)` for `kinds` (a reshard or a restore)."""
        self.pending.difference_update(kinds)

    def local_pieces(self) -> tuple[tuple[int, int], ...]:
        """The global ranges of the flat state this rank holds (its `pieces(k)`, in order)."""
        return self.layout.rank_pieces(self.rank)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Host copies of every kind's local pieces, concatenated (a snapshot's arrays)."""
        if self.pending:
            raise RuntimeError(f"state of rank {self.rank} not loaded yet: {sorted(self.pending)}")
        out = {}
        for kind in self.spec.kinds():
            parts = [t.detach().to("cpu", copy=True) for t in self.pieces(kind) if t.numel()]
            out[kind] = torch.cat(parts) if parts else torch.empty(0, dtype=self.spec.dtype_of(kind))
        return out

    def load_state(self, source: Any, scalars: Mapping[str, Any]) -> None:
        """Fill every kind from `source` (a `reshard.sources.ShardSource` over saved shards of
        any layout), reading only this rank's ranges; then the replicated scalars."""
        from dynaresize.reshard.sources import fill_pieces

        fill_pieces({k: self.pieces(k) for k in self.spec.kinds()}, self.local_pieces(), source)
        self.mark_loaded(self.spec.kinds())
        self.load_scalars(scalars)

    def param_meta(self) -> list[dict]:
        """(name, shape, offset) of every trainable parameter in flattening order."""
        out, off = [], 0
        for name, p in zip(self.names, self.params):
            out.append({"name": name, "shape": list(p.shape), "offset": off})
            off += p.numel()
        return out

    def load_checkpoint(self, directory: str) -> dict:
        """Load a trainer checkpoint saved at any number of ranks (roles/checkpoint.py)."""
        from dynaresize.errors import CheckpointError
        from dynaresize.roles.checkpoint import CheckpointReader, decode_scalars

        reader = CheckpointReader(directory)
        m = reader.manifest
        if [(p["name"], list(p["shape"])) for p in m["params"]] != [(p["name"], p["shape"]) for p in self.param_meta()]:
            raise CheckpointError(f"checkpoint {directory}: its parameters do not match this model")
        self.load_state(reader.source, decode_scalars(m["scalars"]))
        return {"step": self.step, "device": self.rank}

    def state_bytes(self) -> int:
        """Bytes of parameters (a LoRA base too), gradients, moments and reference weights this rank holds,
        measured from the tensors' storages (FSDP's padding included; shared storage once)."""
        seen: dict[int, int] = {}
        tensors = [p.to_local() for p in self.model.parameters()] + [t for k in MOMENT_KINDS for t in self.moments[k]]
        tensors += [p.grad.to_local() for p in self.params if p.grad is not None]
        if self.ref is not None:
            tensors += [p.to_local() for p in self.ref.parameters()]
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return sum(seen.values())

    def scalars(self) -> dict:
        return {"step": self.step, "lr_step": self.lr_step, "seed": self.spec.seed,
                "rng_state": bytes(self.generator.get_state().tolist())}

    def load_scalars(self, scalars: Mapping[str, Any]) -> None:
        self.step, self.lr_step = int(scalars["step"]), int(scalars["lr_step"])
        if int(scalars.get("seed", self.spec.seed)) != self.spec.seed:
            raise ValueError(f"state of seed {scalars['seed']} loaded into a trainer of seed {self.spec.seed}")
        if scalars.get("rng_state") is not None:
            self.generator.set_state(torch.frombuffer(bytearray(scalars["rng_state"]), dtype=torch.uint8))

    def release(self) -> None:
        """Drop every tensor this trainer holds (the device leaves the train role)."""
        self.model = self.ref = None
        self.params, self.moments = [], {k: [] for k in MOMENT_KINDS}
        release_device_memory(self.device)

    # ------------------------------------------------------------------ full weights

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full fp32 weight) of every trainable parameter in order. Collective over the
        training group: every trainer must consume the whole iterator, in step."""
        for name, p in zip(self.names, self.params):
            yield name, p.full_tensor().detach().to(torch.float32)

    def digest(self) -> str:
        """`weight_sync.weights_digest` of the full fp32 weights (collective over the group)."""
        from dynaresize.roles.weight_sync import weights_digest

        return weights_digest(self.full_params())

    # ------------------------------------------------------------------ one step

    @contextlib.contextmanager
    def _rng(self, index: int) -> Iterator[None]:
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(mix_seed(self.spec.seed, self.step, index))
            yield

    def compute_grads(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn, *,
                      num_micro_batches: int) -> dict:
        """Forward/backward of this rank's micro-batches (index i mod W == position) and the
        reduce-scatter of their summed gradient; `loss_fn(model, mb)` returns (loss, stats
        sums) and takes mb None for the zero-weighted dummy. Collective over the group."""
        w, m = len(self.ranks), num_micro_batches
        local = dict(micro_batches)
        expected = set(range(self.index, m, w))
        if set(local) != expected:
            raise ValueError(f"rank position {self.index} of {w} got micro-batches {sorted(local)}, "
                             f"expected {sorted(expected)}")
        self.begin_grads()
        self.add_grads(sorted(local.items()), loss_fn, rounds=math.ceil(m / w))
        return self.reduce_grads(num_micro_batches=m)

    def begin_grads(self) -> None:
        """Start a step's gradient: nothing accumulated yet."""
        for p in self.params:
            p.grad = None
        self._sums = torch.zeros(len(_STAT_NAMES), dtype=torch.float64)
        self._fwd_bwd_s = 0.0

    def add_grads(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn, *, rounds: int) -> None:
        """Forward/backward of this rank's `micro_batches` ((index, micro-batch), in order), one per
        round for `rounds` rounds (a zero-weighted dummy once this rank has none left), added to
        the gradient earlier calls of the step left. Every rank of the group calls it with the same
        `rounds` (FSDP's collectives match round by round). A micro-batch's RNG depends only on its
        index, so the calls a step is cut into do not change what each one computes."""
        if len(micro_batches) > rounds:
            raise ValueError(f"{len(micro_batches)} micro-batches for {rounds} rounds on rank position {self.index}")
        t0 = time.perf_counter()
        for r in range(rounds):
            i, mb = micro_batches[r] if r < len(micro_batches) else (-1 - r, None)
            with self._rng(i):
                loss, stats = loss_fn(self.model, mb)
                loss.backward()
            if mb is not None:
                for j, name in enumerate(_STAT_NAMES[:-1]):
                    self._sums[j] += float(stats.get(name, 0.0))
                self._sums[-1] += 1.0
        self._reshard_roots()
        self._fwd_bwd_s += time.perf_counter() - t0

    def reduce_grads(self, *, num_micro_batches: int, scale: float = 1.0) -> dict:
        """The step's gradient times `scale` (a loss normalised only once the step's token count
        is known), its global norm and clip coefficient, and the step's stats summed over the
        group. Collective over the group."""
        w, m, sums = len(self.ranks), num_micro_batches, self._sums
        t1 = time.perf_counter()
        if scale != 1.0:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.to_local().mul_(scale)
            sums[_STAT_NAMES.index("loss_sum")] *= scale
        self.last_state_bytes = self.state_bytes()  # the peak: gradients and moments both held
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self.params:
            if p.grad is not None:
                sq += p.grad.to_local().double().pow(2).sum()
        both = torch.cat([sums.to(self.device), sq])
        if w > 1:
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.group)
        t2 = time.perf_counter()
        totals = dict(zip(_STAT_NAMES, both[:-1].tolist()))
        if int(totals["micro_batches"]) != m:
            raise RuntimeError(f"{int(totals['micro_batches'])} micro-batches computed over the group, expected {m}")
        norm = math.sqrt(float(both[-1]))
        if self.spec.deterministic:  # fp64 partial sums differ by W in the last bits; fp32 does not
            norm = float(torch.tensor(norm, dtype=torch.float32))
        clip = 1.0
        if self.spec.optim.max_grad_norm > 0:
            clip = min(1.0, self.spec.optim.max_grad_norm / (norm + 1e-6))
        self._grad_coef = clip
        tokens = max(1.0, totals["num_tokens"])
        return {"loss": totals["loss_sum"], "grad_norm": norm, "clip_coef": clip,
                "entropy": totals["entropy_sum"] / tokens, "kl": totals["kl_sum"] / tokens,
                "clip_frac": totals["clipped_tokens"] / tokens, "num_tokens": int(totals["num_tokens"]),
                "num_micro_batches": m, "num_local_micro_batches": int(sums[-1]),
                "fwd_bwd_s": self._fwd_bwd_s, "reduce_s": t2 - t1, "train_state_bytes": self.last_state_bytes}

    def apply_optimizer(self) -> dict:
        """AdamW on this rank's shards from the reduced gradient (clipped by the global norm)."""
        if self._grad_coef is None:
            raise RuntimeError("apply_optimizer called without a reduced gradient (call compute_grads first)")
        if self.pending:
            raise RuntimeError(f"state not loaded on rank {self.rank}: {sorted(self.pending)}")
        o = self.spec.optim
        lr = o.lr_at(self.lr_step)
        t0 = time.perf_counter()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                local = p.to_local()
                if local.numel() == 0:
                    continue
                grad = p.grad.to_local() if p.grad is not None else torch.zeros_like(local)
                if self._grad_coef != 1.0:
                    grad = grad * self._grad_coef
                adamw_update_(local, self.moments["exp_avg"][i], self.moments["exp_avg_sq"][i], grad,
                              step=self.step + 1, lr=lr, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps,
                              weight_decay=o.weight_decay)
        for p in self.params:
            p.grad = None
        self.step += 1
        self.lr_step += 1
        self._grad_coef = None
        return {"lr": lr, "optim_s": time.perf_counter() - t0}

    def forward_rounds(self, micro_batches: Sequence[tuple[int, Any]], num_micro_batches: int,
                       fn: Callable[[nn.Module, Any], Any], *, rounds: int | None = None) -> dict[int, Any]:
        """`fn(model, mb)` without gradients on this rank's micro-batches, in the same rounds as
        `compute_grads` (index i mod W == position; or, with `rounds`, this rank's list in order
        over `rounds` rounds, as `add_grads`); mb None: a dummy, so every rank runs FSDP's
        all-gathers in step. Collective over the group. Returns {micro-batch index: fn's result}."""
        w = len(self.ranks)
        if rounds is None:
            local = dict(micro_batches)
            order = [(r * w + self.index, local.get(r * w + self.index))
                     for r in range(math.ceil(num_micro_batches / w))]
        else:
            order = list(micro_batches) + [(-1 - r, None) for r in range(len(micro_batches), rounds)]
        out: dict[int, Any] = {}
        with torch.no_grad():
            for i, mb in order:
                res = fn(self.model, mb)
                if mb is not None:
                    out[i] = res
        self._reshard_roots()
        return out

    def _reshard_roots(self) -> None:
        """FSDP2 keeps a root module's parameters gathered after forward (for the backward that
        usually follows); after no-grad forwards (the reference model, recomputed log-probs)
        nothing frees them, so free them here: the state view is the sharded one."""
        for m in (self.model, self.ref):
            if m is not None:
                m.reshard()
