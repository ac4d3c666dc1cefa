"""LoRA arithmetic: how many parameters an adapter has, and what a move and a weight sync carry.

A LoRA adapter (peft's `LoraConfig`; verl's `lora_rank`, `target_modules`) adds to each targeted
linear module of weight [out, in] two matrices A [r, in] and B [out, r]: r * (in + out)
parameters (no bias). `train.lora` trains only those; the base weights stay frozen.

What that changes for dynaresize (docs/lora-costs.md):
- a move's trainer state is the adapter and its two AdamW moments: fp32 parameters (4 B) and
  moments (8 B) per adapter parameter, `ADAPTER_MOVE_BYTES_PER_PARAM`, where a full job moves
  the same 12 B for every parameter of the model; the base weights are never moved (each
  device loads them from the model folder);
- a weight sync sends the whole adapter in the engine's dtype (never a delta, never the base);
- the trainers' checkpointed state is the adapter's 16 B/param (parameters, gradients, moments);
- the reference model is the base itself (no second copy).

Which modules "all-linear" targets, as peft does (`peft.tuners.tuners_utils`, its
`INCLUDE_LINEAR_LAYERS_SHORTHAND`): every linear layer of the decoder blocks but the output
head. For a dense Qwen2 / Qwen3 / Llama block: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj. For a mixture-of-experts block, what peft 0.21 wraps with all-linear on
transformers 5's fused experts (Qwen3-MoE, Mixtral): the router (`gate`, [E, hidden]) and each
routed expert's fused gate_up [2I, hidden] at rank 2r and down [hidden, I] at rank r
(peft's `target_parameters` with its `rank_pattern`); a shared expert's gate/up/down and its
gate are plain linears. Counted against peft's own count in tests/unit/test_lora_costs.py.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_LINEAR = "all-linear"
# fp32 adapter parameters (4 B) and their two fp32 AdamW moments (8 B): what a move carries.
ADAPTER_MOVE_BYTES_PER_PARAM = 12.0
# What the trainers hold per adapter parameter: fp32 parameters, gradients, two moments.
ADAPTER_STATE_BYTES_PER_PARAM = 16.0
# The frozen base on the trainers: fp32 (roles/lora_model.py fills the wrapped model's rows as fp32).
FROZEN_BASE_BYTES_PER_PARAM = 4.0
# The dense block's linear modules, by their HF name.
DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Names a mixture-of-experts block adds: the router, the routed experts (fused), the shared expert's gate.
MOE_MODULES = ("gate", "experts", "shared_expert_gate")


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The linear layers' sizes of a decoder-only transformer (dense, or with routed experts).

    `intermediate_size`: a dense block's MLP width (0: the blocks have no dense MLP).
    `num_experts` > 0: routed experts of width `moe_intermediate_size`, with a router; a shared
    expert of width `shared_expert_intermediate_size` (> 0) and its sigmoid gate."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderShape.{name}={getattr(self, name)}: must be >= 1")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"DecoderShape.moe_intermediate_size={self.moe_intermediate_size}: must be >= 1 "
                             f"with num_experts={self.num_experts}")
        if not self.num_experts and self.intermediate_size < 1:
            raise ValueError(f"DecoderShape.intermediate_size={self.intermediate_size}: must be >= 1 for a dense model")


@dataclass(frozen=True, kw_only=True)
class LinearShape:
    """One kind of adapted weight in a block: `count` matrices of [out, in], each at rank
    `rank_factor` x r (peft's fused gate_up of routed experts: 2)."""

    name: str
    in_features: int
    out_features: int
    count: int = 1
    rank_factor: int = 1

    def adapter_params(self, rank: int) -> int:
        return self.count * self.rank_factor * rank * (self.in_features + self.out_features)


def block_linears(shape: DecoderShape) -> tuple[LinearShape, ...]:
    """The weights of one decoder block that LoRA can adapt, by the name a target matches."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = [LinearShape(name="q_proj", in_features=h, out_features=q),
           LinearShape(name="k_proj", in_features=h, out_features=kv),
           LinearShape(name="v_proj", in_features=h, out_features=kv),
           LinearShape(name="o_proj", in_features=q, out_features=h)]
    mlp = shape.shared_expert_intermediate_size if shape.num_experts else shape.intermediate_size
    if mlp:  # the dense MLP, or a MoE block's shared expert: plain linears
        out += [LinearShape(name="gate_proj", in_features=h, out_features=mlp),
                LinearShape(name="up_proj", in_features=h, out_features=mlp),
                LinearShape(name="down_proj", in_features=mlp, out_features=h)]
    if shape.num_experts:
        e, i = shape.num_experts, shape.moe_intermediate_size
        out += [LinearShape(name="gate", in_features=h, out_features=e),
                LinearShape(name="experts", in_features=h, out_features=2 * i, count=e, rank_factor=2),
                LinearShape(name="experts", in_features=i, out_features=h, count=e)]
        if shape.shared_expert_intermediate_size:
            out.append(LinearShape(name="shared_expert_gate", in_features=h, out_features=1))
    return tuple(out)


def check_targets(target_modules: tuple[str, ...]) -> None:
    """A ValueError naming what no block of any model here has (a typo is not silently zero)."""
    known = DENSE_MODULES + MOE_MODULES
    bad = [t for t in target_modules if t != ALL_LINEAR and t not in known]
    if not target_modules or bad:
        raise ValueError(f"target_modules={','.join(bad) or '()'}: unknown (known: {ALL_LINEAR}, {', '.join(known)})")


def adapter_params(shape: DecoderShape, rank: int, target_modules: tuple[str, ...] = (ALL_LINEAR,)) -> int:
    """Parameters of a rank-`rank` adapter on the targeted modules of every block (never the
    embeddings or the output head)."""
    if rank < 1:
        raise ValueError(f"LoRA rank={rank}: must be >= 1")
    check_targets(tuple(target_modules))
    every = ALL_LINEAR in target_modules
    per_block = sum(m.adapter_params(rank) for m in block_linears(shape) if every or m.name in target_modules)
    return shape.num_layers * per_block


def move_bytes(num_adapter_params: float) -> float:
    """All trainers' share of what moves in a resize: the adapter's fp32 parameters and moments."""
    return ADAPTER_MOVE_BYTES_PER_PARAM * float(num_adapter_params)


def state_bytes(num_adapter_params: float) -> float:
    """All trainers' adapter state: fp32 parameters, gradients, two moments (a checkpoint's)."""
    return ADAPTER_STATE_BYTES_PER_PARAM * float(num_adapter_params)


def trainer_bytes(num_params: float, num_adapter_params: float) -> float:
    """All trainers' bytes of state in a LoRA job: the frozen fp32 base (which is also the
    reference model) and the adapter's 16 B/param."""
    return FROZEN_BASE_BYTES_PER_PARAM * float(num_params) + state_bytes(num_adapter_params)


def sync_bytes(num_adapter_params: float, elem_bytes: float = 2.0) -> float:
    """Bytes one engine receives in a weight sync: the whole adapter in the wire dtype."""
    return float(elem_bytes) * float(num_adapter_params)
