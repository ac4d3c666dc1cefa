"""Bytes per device: the one place that says how much memory a role's state takes.

Used by the simulator's bounds and resize costs (`costs.min_train_devices`,
`ModelPreset.train_state_bytes`), the emulator (the same bounds) and docs/gpu.md (its tables
are this module's output, checked by tests/unit/test_memory.py).

The trainer (FSDP2 with fp32 master weights, roles/train_fsdp.py) holds per parameter:
fp32 parameters (4 B), fp32 gradients (4 B) and two fp32 AdamW moments (8 B): 16 B, divided
over the W training devices. A frozen reference model (KL on) adds its fp32 copy (4 B). What
is transient (the all-gathered bf16 block of the layer being computed, activations, logits)
is not state: it lives in the share of memory the floor leaves free. With LoRA: the frozen fp32
base (also the reference) and the adapter's 16 B/param (`MemoryInputs.adapter_params`).

The plan before start (`ModelShape`, `MemoryInputs`, `trainer_peak`, `engine_peak`, `op_peaks`,
`split_fit`, `plan_splits`) counts every byte of one device in each role and resize op for a
model's exact shape and a run's config: `dynaresize preflight` prints it and `dynaresize run`
checks its starting split with it on CUDA (commands/preflight.py). Its estimates (CUDA context,
NCCL buffers, activations per token) say where their numbers come from. The simulator's floor
stays `min_train_devices_for` (the state in 70% of a device), a config-free rule.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# fp32 master (4) + fp32 gradient (4) + two fp32 AdamW moments (8), as roles/train_fsdp.py
# holds them and measures them (`train_state_bytes` in its stats, docs/training.md).
TRAIN_STATE_BYTES_PER_PARAM = 16.0
# A frozen fp32 reference model, where the KL term needs one.
REFERENCE_BYTES_PER_PARAM = 4.0
# The share of a device's memory the sharded training state may take; the rest is for
# activations, the gathered block and communicator buffers.
TRAIN_STATE_HBM_FRACTION = 0.7


def train_state_bytes(num_params: float, *, reference: bool = False) -> float:
    """All trainers' state together, in bytes (divide by W for one device's share)."""
    per_param = TRAIN_STATE_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if reference else 0.0)
    return per_param * float(num_params)


def train_state_budget_bytes(hbm_bytes: float) -> float:
    """The bytes of one device the training state's share may use."""
    return TRAIN_STATE_HBM_FRACTION * float(hbm_bytes)


def min_train_devices_for(num_params: float, hbm_bytes: float, *, reference: bool = False) -> int:
    """The memory floor: the fewest training devices whose shares of the state fit their budget."""
    need = train_state_bytes(num_params, reference=reference)
    return max(1, math.ceil(need / train_state_budget_bytes(hbm_bytes)))


# ----------------------------------------------------------------- the plan before start
#
# `dynaresize preflight` and the start of a CUDA run (commands/preflight.py) count every byte
# a device holds in each role and resize op, for a model's exact shape (`ModelShape`, read from
# its config.json by roles/model_shape.py) and the run's config (`MemoryInputs`). Bytes are
# exact where the code fixes them (state, weights, KV per token, sync buckets) and estimates
# where the hardware or a library decides; each estimate below says where its number comes from.

GiB = float(1 << 30)
MiB = float(1 << 20)

# CUDA context and torch's start-up allocations on one device, with one NCCL communicator:
# 542 MiB in use over the start, measured by scripts/device_check.sh on one H200 (torch 2.11,
# CUDA 13; docs/gpu.md). It varies with the driver, CUDA's lazy module loading and the kernels
# a process loads; vLLM's own CUDA graphs are inside its budget (below), not here. [measured]
CUDA_CONTEXT_BYTES = 542 * MiB
# One NCCL communicator's device buffers: NCCL_BUFFSIZE is 4 MiB per channel and peer by default
# (NCCL's environment-variable docs, docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html);
# a ring or tree collective keeps send and receive buffers towards two peers, and an NVLink node
# runs up to 16-32 channels: 4 MiB x 2 peers x 32 channels = 256 MiB, the upper end. [assumption]
NCCL_COMM_BYTES = 256 * MiB
# Communicators a device holds at once: the world, its role's group (training data-parallel, or a
# TP replica), the weight-sync group, and one pre-warmed for the next split. [assumption]
COMMS_PER_DEVICE = 4
# What a vLLM engine keeps of its `gpu_memory_utilization` budget for activations of its profile
# run (`max_num_batched_tokens` tokens through one layer at a time) and the sampler's logits; the
# rest after the weights is KV cache. The figure docs/gpu.md's rollout table used (about 2 GB).
# [assumption]
ENGINE_RESERVE_BYTES = 2e9
# A parked engine (rollout.engine_release = park) on a device now training: sleep frees its
# weights and KV cache; what stays is its CUDA graph pool and allocator blocks. vLLM's own start-up
# message says CUDA graphs take 1-3 GiB per GPU (vllm/worker/model_runner.py, "CUDA graphs can take
# additional 1~3 GiB memory per GPU"): 2 GiB. [assumption, from vLLM's message]
PARKED_ENGINE_BYTES = 2 * GiB
# Bytes per element by dtype name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "float32": 4, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder model's shape and exact parameter counts (what the plan needs, nothing loaded)."""

    name: str
    num_params: int  # every distinct parameter (a tied embedding counted once)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_params: int  # one decoder block (FSDP2's unit)
    root_params: int  # the rest: embeddings, lm_head, final norm (the root FSDP unit)
    largest_param: int  # elements of the largest single parameter (gathered whole for a weight sync)
    # Two consecutive weight-sync buckets at most (roles/weight_sync.py), by wire element bytes.
    sync_staging_bytes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "layer_params", "largest_param"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name}={getattr(self, name)}: must be > 0")

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """K and V of one token over all layers (vllm_memory.kv_bytes_per_token's formula)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes

    def staging_bytes(self, elem_bytes: int) -> int:
        return dict(self.sync_staging_bytes).get(elem_bytes, 0)


@dataclass(frozen=True, kw_only=True)
class MemoryInputs:
    """What the run's config says about memory (commands/preflight.py fills it from a RunConfig)."""

    micro_batch_size: int
    seq_tokens: int  # prompt + response budget: a micro-batch is padded to its longest sample
    train_dtype: str = "fp32"  # compute dtype (FSDP2's param_dtype); master, gradients, moments stay fp32
    activation_checkpointing: bool = False
    reference: bool = False  # kl_coef > 0: a frozen fp32 reference model, sharded like the policy
    engine: str = "vllm"  # vllm | hf
    engine_dtype: str = "bf16"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.85
    kv_cache_bytes: int = 0  # rollout.vllm_kv_cache_bytes; 0: what gpu_memory_utilization leaves
    max_model_len: int = 0  # one request's prompt + response; 0: seq_tokens
    hf_batch_rows: int = 4
    reshard_staging_bytes: int = 4 << 20
    engine_release: str = "park"
    logprob_chunk_tokens: int = 0  # train.logprob_chunk_tokens: the loss's head in chunks; 0: whole logits
    adapter_params: int = 0  # train.lora: the adapter's parameters (0: every weight trains)

    def __post_init__(self) -> None:
        for name, least in (("micro_batch_size", 1), ("seq_tokens", 1), ("tensor_parallel", 1), ("hf_batch_rows", 1),
                            ("adapter_params", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"MemoryInputs.{name}={getattr(self, name)}: must be >= {least}")
        for name in ("train_dtype", "engine_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"MemoryInputs.{name}={getattr(self, name)!r}: must be fp32 or bf16")
        if self.engine not in ("vllm", "hf"):
            raise ValueError(f"MemoryInputs.engine={self.engine!r}: must be vllm or hf")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"MemoryInputs.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch, padded."""
        return self.micro_batch_size * self.seq_tokens

    @property
    def request_tokens(self) -> int:
        return self.max_model_len or self.seq_tokens


@dataclass(frozen=True, kw_only=True)
class Peak:
    """A device's peak bytes in one role or op, and what they are made of (name -> bytes)."""

    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return float(sum(b for _, b in self.parts))

    def largest(self) -> str:
        return max(self.parts, key=lambda p: p[1])[0]

    def as_dict(self) -> dict[str, float]:
        return dict(self.parts)


def device_overhead_bytes() -> float:
    """CUDA context plus the communicators' buffers: held by every device in every role."""
    return CUDA_CONTEXT_BYTES + COMMS_PER_DEVICE * NCCL_COMM_BYTES


def layer_activation_bytes_per_token(shape: ModelShape, dtype: str) -> float:
    """Bytes one token leaves saved for backward in one Qwen2/Llama decoder block.

    Counted tensor by tensor as Korthikanti et al. 2022 ("Reducing Activation Recomputation in
    Large Transformer Models", arXiv 2205.05198, section 4) count a GPT block (34 h bytes per token
    with 16-bit activations and a 4h MLP), for this block's ops instead, with e bytes per
    activation element (the compute dtype) and q = heads x head dim:
    - two RMSNorms, each saving its fp32 upcast input (4h) and its normalised output cast back (e h);
    - the q/k/v projections' input (e h); q, and k and v repeated to every query head (3 e q), and
      the attention output (e q), saved by SDPA (a fused kernel keeps no s x s scores, only a
      4-byte log-sum-exp per head); the output projection's input (e q, a contiguous copy);
    - the MLP's input (e h); gate, SiLU(gate), up and their product (4 e I).
    RoPE's multiplications save only cos and sin (shared); residual adds save nothing.
    Total: 8h + 4 e h + 5 e q + 4 e I + 4 heads. For Qwen2-7B in bf16: 244,848 B (Korthikanti's
    34h would give 121,856 B for a 4h MLP; Qwen2's MLP is 5.3h wide)."""
    e = DTYPE_BYTES[dtype]
    h, q, i = shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size
    return float(8 * h + 4 * e * h + 5 * e * q + 4 * e * i + 4 * shape.num_heads)


def activation_bytes(shape: ModelShape, inp: MemoryInputs, *, checkpointing: bool) -> float:
    """Activations saved over one micro-batch's forward, at their peak (the start of backward).

    Without checkpointing every block keeps its tensors; with it (HF's per-block checkpointing)
    each block keeps only its input (e h per token) and one block's tensors are alive again while
    it is recomputed. Plus the final norm and lm_head's input (4h + 2 e h per token) and the
    padding mask SDPA gets (one byte per (query, key) pair per sample)."""
    e = DTYPE_BYTES[inp.train_dtype]
    t, h = inp.tokens, shape.hidden_size
    per_layer = layer_activation_bytes_per_token(shape, inp.train_dtype) * t
    blocks = shape.num_layers * (e * h * t) + per_layer if checkpointing else shape.num_layers * per_layer
    head = (4 * h + 2 * e * h) * t
    mask = inp.micro_batch_size * inp.seq_tokens ** 2
    return float(blocks + head + mask)


def logits_bytes(shape: ModelShape, inp: MemoryInputs) -> float:
    """The loss's logits (rl/grpo.py `response_logprobs`): lm_head's output in the compute
    dtype, its fp32 log-softmax and that log-softmax's fp32 gradient in backward: rows x vocab x
    (e + 8), where rows are the micro-batch's tokens, or with `logprob_chunk_tokens` one chunk
    (rl/logprobs.py: a chunk is recomputed in backward; what stays is 8 bytes per token)."""
    rows = inp.tokens if inp.logprob_chunk_tokens <= 0 else min(inp.logprob_chunk_tokens, inp.tokens)
    kept = 0 if inp.logprob_chunk_tokens <= 0 else 8 * inp.tokens
    return float(rows * shape.vocab_size * (DTYPE_BYTES[inp.train_dtype] + 8) + kept)


def trainer_peak(shape: ModelShape, inp: MemoryInputs, num_train: int) -> Peak:
    """One training device's peak with `num_train` trainers (FSDP2, roles/train_fsdp.py).

    State (16 B/param, plus 4 with a reference model) falls as 1/W. FSDP2 all-gathers in the
    compute dtype: the root unit (embeddings, lm_head, final norm) stays gathered through forward
    and backward, a block is gathered with the next one prefetched; the root's gradients live
    unsharded through backward and a block's are cast to fp32 for its reduce-scatter. The optimizer
    step (per-tensor AdamW on local shards) and the weight sync (every parameter gathered whole in
    fp32, the root packing two buckets) come after backward, so the peak is the larger of them."""
    w = max(1, int(num_train))
    e = DTYPE_BYTES[inp.train_dtype]
    n = float(shape.num_params)
    a = float(inp.adapter_params)  # LoRA: only the adapter has gradients and moments
    act = activation_bytes(shape, inp, checkpointing=inp.activation_checkpointing)
    gathered = shape.root_params * e + 2 * shape.layer_params * e
    grads_unsharded = (a / shape.num_layers * (e + (4 if e != 4 else 0)) if a
                       else shape.root_params * e + shape.layer_params * (e + (4 if e != 4 else 0)))
    fwd_bwd = gathered + grads_unsharded + act + logits_bytes(shape, inp)
    # roles/train_state.adamw_update_ on the largest local shard: the clipped gradient (grad * coef),
    # exp_avg_sq.sqrt() and its division by the bias correction are alive at once: 3 fp32 temporaries.
    # With LoRA the optimizer and the weight sync touch the adapter's tensors only (each <= a).
    largest = min(shape.largest_param, a or shape.largest_param)
    staged = min(shape.staging_bytes(DTYPE_BYTES[inp.engine_dtype]), 2 * DTYPE_BYTES[inp.engine_dtype] * a or math.inf)
    optim, sync = 3 * 4 * largest / w, 4 * largest + staged
    parts: list[tuple[str, float]] = [("parameters", 4 * (n + a) / w), ("gradients", 4 * (a or n) / w),
                                      ("moments", 8 * (a or n) / w)]
    if inp.reference and not a:  # with LoRA the reference is the base with the adapter disabled
        parts.append(("reference", REFERENCE_BYTES_PER_PARAM * n / w))
    if fwd_bwd >= max(optim, sync):
        parts += [("gathered", gathered + grads_unsharded), ("activations", act), ("logits", logits_bytes(shape, inp))]
    else:
        parts.append(("optimizer" if optim >= sync else "weight_sync", max(optim, sync)))
    parts.append(("context_comms", device_overhead_bytes()))
    if inp.engine_release == "park":
        parts.append(("parked_engine", PARKED_ENGINE_BYTES))
    return Peak(parts=tuple(parts))


def engine_kv_bytes(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float) -> float:
    """The KV cache one rollout device holds: the configured bytes, or what the vLLM budget
    leaves after the weights and the reserve (HF engine: one batch of requests)."""
    if inp.engine == "hf":
        return float(inp.hf_batch_rows * inp.request_tokens
                     * shape.kv_bytes_per_token(DTYPE_BYTES[inp.engine_dtype]) / inp.tensor_parallel)
    if inp.kv_cache_bytes:
        return float(inp.kv_cache_bytes)
    weights = shape.num_params * DTYPE_BYTES[inp.engine_dtype] / inp.tensor_parallel
    return inp.gpu_memory_utilization * hbm_bytes - weights - ENGINE_RESERVE_BYTES


def engine_peak(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float) -> Peak:
    """One rollout device's peak. vLLM starts only when `gpu_memory_utilization` x the device is
    free (its GPU worker raises "Free memory on device ... on startup is less than desired GPU
    memory utilization" otherwise: vllm/v1/worker/gpu_worker.py) and then uses all of it (weights, its reserve, KV), so the device holds that budget on
    top of what was there before it (context, communicators) plus a weight sync's staging (two
    buckets in the engine's dtype, received outside the engine). The HF engine: weights, one
    batch's KV and fp32 logits."""
    ed = DTYPE_BYTES[inp.engine_dtype]
    k = inp.tensor_parallel
    weights = shape.num_params * ed / k
    kv = engine_kv_bytes(shape, inp, hbm_bytes)
    if inp.engine == "hf":
        engine = [("weights", weights), ("kv", kv), ("logits", 4.0 * inp.hf_batch_rows * shape.vocab_size)]
    else:
        engine = [("weights", weights), ("reserve", ENGINE_RESERVE_BYTES), ("kv", kv)]
    return Peak(parts=tuple(engine) + (("sync_staging", float(shape.staging_bytes(ed))),
                                        ("context_comms", device_overhead_bytes())))


def op_peaks(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float, num_train: int) -> dict[str, Peak]:
    """Peak bytes of one device in each resize op at a split with `num_train` trainers
    (docs/resize.md's ops; the moves are to and from this split)."""
    w = max(1, int(num_train))
    from dynaresize.costmodel.lora import trainer_bytes  # LoRA: the frozen base and the adapter's state
    n, a = shape.num_params, inp.adapter_params
    state = trainer_bytes(n, a) if a else train_state_bytes(n, reference=inp.reference)
    base = ("context_comms", device_overhead_bytes())
    staging = ("reshard_staging", float(inp.reshard_staging_bytes))
    parked = (("parked_engine", PARKED_ENGINE_BYTES),) if inp.engine_release == "park" else ()
    return {
        # a device leaving training sends its shards away in bounded chunks before its engine starts
        "leave_training": Peak(parts=(("train_state", state / w), staging, base)),
        # the remaining or joining trainers receive shards into their share at W (bounded chunks)
        "reshard_in": Peak(parts=(("train_state", state / w), staging, base) + parked),
        # vLLM's start needs its whole budget free on a device that trained: only context and communicators stay
        "engine_start": Peak(parts=(("engine_budget", inp.gpu_memory_utilization * hbm_bytes
                                     if inp.engine == "vllm" else engine_peak(shape, inp, hbm_bytes).total
                                     - device_overhead_bytes()), base)),
        # a weight sync on the root trainer: every parameter gathered whole in fp32, two buckets packed
        "weight_sync_trainer": Peak(parts=(("train_state", state / w), ("gathered_param", 4.0 * shape.largest_param),
                                           ("buckets", float(shape.staging_bytes(DTYPE_BYTES[inp.engine_dtype]))),
                                           base) + parked),
    }


@dataclass(frozen=True, kw_only=True)
class SplitFit:
    """Whether one split fits a device of `hbm_bytes`, and what limits it."""

    rollout: int
    train: int
    fits: bool
    train_peak: Peak
    rollout_peak: Peak
    ops: dict
    limit: str

    def to_json(self) -> dict:
        return {"rollout": self.rollout, "train": self.train, "fits": self.fits,
                "peak_bytes": {"train": round(self.train_peak.total), "rollout": round(self.rollout_peak.total)},
                "limit": self.limit,
                "train_parts": {k: round(v) for k, v in self.train_peak.parts},
                "ops": {name: round(p.total) for name, p in self.ops.items()}}


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def engine_problem(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float) -> str | None:
    """Why no rollout device of `hbm_bytes` can run this engine (None: one can)."""
    ed = DTYPE_BYTES[inp.engine_dtype]
    per_token = shape.kv_bytes_per_token(ed) / inp.tensor_parallel
    kv = engine_kv_bytes(shape, inp, hbm_bytes)
    peak = engine_peak(shape, inp, hbm_bytes)
    if peak.total > hbm_bytes:
        return f"rollout needs {_gb(peak.total)} > {_gb(hbm_bytes)} per device ({peak.largest()} the largest part)"
    if kv < per_token * inp.request_tokens:
        return (f"rollout: the KV cache left ({_gb(max(kv, 0.0))}, {max(kv, 0.0) / per_token:.0f} tokens) holds less "
                f"than one request of {inp.request_tokens} tokens (weights {_gb(peak.as_dict()['weights'])} per device; "
                f"raise rollout.tensor_parallel or rollout.gpu_memory_utilization)")
    return None


def split_fit(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float, *, rollout: int, train: int) -> SplitFit:
    """One split: fits when every trainer, every rollout device and every resize op at it fits."""
    tp, rp = trainer_peak(shape, inp, train), engine_peak(shape, inp, hbm_bytes)
    ops = op_peaks(shape, inp, hbm_bytes, train)
    problems = []
    if tp.total > hbm_bytes:
        problems.append(f"train needs {_gb(tp.total)} > {_gb(hbm_bytes)} per device ({tp.largest()} "
                        f"{_gb(tp.as_dict()[tp.largest()])})")
    if (why := engine_problem(shape, inp, hbm_bytes)) is not None:
        problems.append(why)
    for name, p in ops.items():
        if p.total > hbm_bytes:
            problems.append(f"{name} needs {_gb(p.total)} > {_gb(hbm_bytes)}")
    if problems:
        limit = "; ".join(problems)
    else:
        role, peak = max((("train", tp), ("rollout", rp)), key=lambda r: r[1].total)
        limit = f"{role} {_gb(peak.total)} of {_gb(hbm_bytes)} ({peak.largest()} {_gb(peak.as_dict()[peak.largest()])})"
    return SplitFit(rollout=rollout, train=train, fits=not problems, train_peak=tp, rollout_peak=rp, ops=ops,
                    limit=limit)


def plan_splits(shape: ModelShape, inp: MemoryInputs, hbm_bytes: float, *, num_devices: int,
                rollout_sizes: Sequence[int]) -> list[SplitFit]:
    """`split_fit` for each rollout-pool size (the splits the bounds allow), ascending."""
    return [split_fit(shape, inp, hbm_bytes, rollout=r, train=num_devices - r) for r in sorted(rollout_sizes)]
