"""Cost model: model presets on H100-class nodes (and named H200 / A100 devices), stage-time
constants and resize op costs. The accelerators (`hardware`) and the model presets
(`model_presets`) live in their own modules and are re-exported here.

Every constant cites docs/references.md by section number. Status letters follow that page:
[V] verified in the primary source, [S] secondary, [U] unverified, [D] derived, [A] an
assumption of this model (stated, not sourced).

Stage models (used by `sim.engine`):
- Rollout, per replica of `tp` devices, continuous batching, memory-bound decode (5, 7.3):
  one decode step costs  eff * (weights/tp + kv_bytes_per_token/tp * context_tokens) / HBM_BW
  + flops_per_token * batch / (tp * peak * mfu_decode). Summed over a replica's decode steps
  this is  steps * t_weights + context_token_reads * t_kv + generated_tokens * t_flop.
  Concurrency is limited by KV memory (7.3).
- Training: 6 * N * tokens (+ causal attention) FLOPs, plus a forward-only old-log-prob pass
  (2N of 6N, i.e. +1/3; references 2.4 measures 0.25-0.5x of the update), divided over the
  training devices at `mfu_train`, plus a fixed exposed communication time per step.
- Weight sync: alpha + bytes per receiver / BW_eff (3.2). With delta sync
  (`rollout.weight_sync = delta`, roles/delta_sync.py) a step sends, per element, the cheapest
  of indices + values, a bitmap + values, or dense at the change fraction `f` (`delta_bytes`); a
  joining engine gets the full weights (its move pays the difference, `OP_COSTS["load_weights"]`).
- LoRA (`train.lora`, `with_lora`): the trainable state is the adapter (costmodel/lora.py), so a
  move's shards are the adapter's fp32 parameters and moments, a weight sync sends the whole
  adapter in bf16 (never a delta, never the base), and the trainers hold the frozen base besides
  the adapter's state (the memory floor). The base never crosses the network: a device that
  joins training reads its share of the base from the model folder on its own host.
- Resize ops: the planner's op names (control/planner.py) (shared with the runtime executor through
  `control.planner`); each has a duration and a byte count here.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dynaresize.costmodel import lora as lora_math
from dynaresize.costmodel import memory
from dynaresize.costmodel.hardware import GB, HARDWARE_PRESETS, Hardware, get_hardware  # noqa: F401 (re-exported)
from dynaresize.costmodel.model_presets import (DEFAULT_CHANGED_FRACTION, FROZEN_BASE_BYTES_PER_PARAM,  # noqa: F401
                                                MODEL_PRESETS, ModelPreset, get_model)
from dynaresize.errors import ConfigError

# LoRA: a trainer built at a new training size reads its rows of the base from the model folder
# (bf16 on disk) on its own host (roles/lora_model.py `LoraRows`: a base never moves).
BASE_FOLDER_BYTES_PER_PARAM = 2.0


@dataclass(frozen=True, kw_only=True)
class RolloutConstants:
    """Per-replica decode constants, in seconds."""

    t_weights: float  # one decode step's weight read (the batch-independent part)
    t_kv: float  # per context token read in a decode step
    t_flop: float  # per generated token (compute)
    t_prefill: float  # per prompt token (compute)
    kv_capacity_tokens: float  # KV tokens one replica holds
    max_num_seqs: int


def rollout_constants(model: ModelPreset, hw: Hardware = Hardware()) -> RolloutConstants:
    tp = model.rollout_tp
    free = tp * hw.hbm_bytes * (1.0 - model.kv_reserve_frac) - model.weight_bytes
    if free <= 0:
        raise ConfigError([f"model={model.name!r}: weights do not fit a TP{tp} replica"])
    return RolloutConstants(
        t_weights=model.decode_eff * model.weight_bytes / tp / hw.hbm_bw,
        t_kv=model.decode_eff * model.kv_bytes_per_token / tp / hw.hbm_bw,
        t_flop=2.0 * model.num_params / (tp * hw.peak_flops * model.mfu_decode),
        t_prefill=2.0 * model.num_params / (tp * hw.peak_flops * model.mfu_prefill),
        kv_capacity_tokens=free / model.kv_bytes_per_token,
        max_num_seqs=model.max_num_seqs,
    )


def train_flops(model: ModelPreset, seq_tokens_sum: float, seq_tokens_sq_sum: float) -> float:
    """FLOPs of one training stage: 6N per token plus causal attention (3 * layers * hidden * T^2
    per sequence of T tokens), plus the forward-only old-log-prob pass. With LoRA the frozen
    base skips its weight gradients (2N of the 6N: forward 2N and the input gradients 2N stay)
    and the adapter adds its own 6 per parameter [D]."""
    per_token = (4.0 * model.num_params + 6.0 * model.adapter_params) if model.lora_rank else 6.0 * model.num_params
    dense = per_token * seq_tokens_sum
    attn = 3.0 * model.num_layers * model.hidden_size * seq_tokens_sq_sum
    return (dense + attn) * (1.0 + model.old_logprob_frac)


def train_device_s(model: ModelPreset, seq_tokens_sum: float, seq_tokens_sq_sum: float,
                   hw: Hardware = Hardware()) -> float:
    """Device-seconds of training compute (divide by the number of training devices)."""
    return train_flops(model, seq_tokens_sum, seq_tokens_sq_sum) / (hw.peak_flops * model.mfu_train)


def min_train_devices(model: ModelPreset, hw: Hardware = Hardware()) -> int:
    """Memory floor: the sharded training state must fit in ~70% of HBM (activations need the rest);
    with LoRA that state is the frozen fp32 base and the adapter's (`trainer_held_bytes`)."""
    if not model.lora_rank:
        return memory.min_train_devices_for(model.num_params, hw.hbm_bytes)
    return max(1, math.ceil(model.trainer_held_bytes / memory.train_state_budget_bytes(hw.hbm_bytes)))


def delta_bytes(num_params: float, changed_fraction: float, elem_bytes: float = 2.0) -> float:
    """Bytes of a delta sync of `num_params` values of `elem_bytes` with `changed_fraction` of
    them changed: per element the cheapest of int32 index + value, a bitmap bit + value, or the
    value dense, the choice roles/delta_sync.py makes per bucket (`encoded_bytes`)."""
    f = min(max(float(changed_fraction), 0.0), 1.0)
    e = float(elem_bytes)
    return num_params * min(f * (4.0 + e), 0.125 + f * e, e)


def sync_bytes(model: ModelPreset, *, full: bool = False) -> float:
    """Bytes one rollout replica receives in a weight sync: the bf16 weights, or with delta sync
    a step's changed values (`full`: a joining engine's, always the whole weights). With LoRA
    the whole adapter in bf16, a joining engine's too: its base is the model folder's, resident
    since the engine first loaded it, and never changes."""
    if model.lora_rank:
        return lora_math.sync_bytes(model.adapter_params)
    if full or model.weight_sync != "delta":
        return model.weight_bytes
    return delta_bytes(model.num_params, model.sync_changed_fraction)


def sync_s(model: ModelPreset, *, full: bool = False) -> float:
    """Weight sync trainer -> rollout: each rollout device receives its bytes / tp (3.2)."""
    return model.sync_alpha_s + sync_bytes(model, full=full) / model.rollout_tp / model.sync_bw


def with_lora(model: ModelPreset, rank: int, target_modules: tuple[str, ...] = (lora_math.ALL_LINEAR,), *,
              field: str = "lora_") -> ModelPreset:
    """`model` training a rank-`rank` LoRA adapter on `target_modules` (rank 0: full training).
    With LoRA a sync sends the whole adapter: a model syncing deltas is refused."""
    from dataclasses import replace

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError([f"{field}rank={rank!r}: must be an integer >= 1 (0: full training)"])
    if not rank:
        return replace(model, lora_rank=0)
    try:
        lora_math.check_targets(tuple(target_modules))
    except ValueError as exc:
        raise ConfigError([f"{field}{exc}"]) from None
    if model.weight_sync == "delta":
        raise ConfigError(["weight_sync='delta': a LoRA job's weight sync sends the whole adapter (full)"])
    out = replace(model, lora_rank=rank, lora_targets=tuple(target_modules))
    out.adapter_params  # a preset without the shape a LoRA adapter needs: ConfigError now
    return out


def lora_of(model: ModelPreset, cfg) -> ModelPreset:
    """`model` with run config `cfg`'s `train.lora` (read duck-typed; None: as it is)."""
    spec = getattr(getattr(cfg, "train", None), "lora", None)
    return model if spec is None else with_lora(model, int(spec.rank), tuple(spec.target_modules), field="train.lora.")


def sync_mode_of(cfg) -> str:
    """`rollout.weight_sync` of run config `cfg` (read duck-typed) as a CPU run resolves it:
    `auto` is delta where the engine's dtype is bf16 (`rollout.dtype`, or `train.dtype` under
    auto), as roles/delta_sync.py `resolve_mode` does; with `train.lora`, full (the adapter whole)."""
    mode, r = cfg.rollout.weight_sync, cfg.rollout.dtype
    if getattr(cfg.train, "lora", None) is not None:
        return "full"
    if mode != "auto":
        return mode
    return "delta" if r == "bf16" or (r == "auto" and cfg.train.dtype == "bf16") else "full"


def with_sync(model: ModelPreset, mode: str, changed_fraction: float | None = None) -> ModelPreset:
    """`model` syncing weights in `mode` (full | delta) at `changed_fraction` (None: the
    preset's, `DEFAULT_CHANGED_FRACTION` unless set). A LoRA job's sync is the adapter whole."""
    from dataclasses import replace

    if mode not in ("full", "delta"):
        raise ConfigError([f"weight_sync={mode!r}: must be full or delta"])
    if mode == "delta" and model.lora_rank:
        raise ConfigError(["weight_sync='delta': a LoRA job's weight sync sends the whole adapter (full)"])
    f = model.sync_changed_fraction if changed_fraction is None else float(changed_fraction)
    if not 0.0 <= f <= 1.0:
        raise ConfigError([f"changed_fraction={changed_fraction}: must be in [0, 1]"])
    return replace(model, weight_sync=mode, sync_changed_fraction=f)


def publish_s(model: ModelPreset, num_train: int, hw: Hardware = Hardware()) -> float:
    """Streaming pipeline, trainer side of a weight sync: the control-plane pause (alpha, 3.2)
    plus each trainer copying its bf16 shard (weights / n; with LoRA the adapter's) to the host
    staging buffer over PCIe D2H (53 GB/s measured, 5). Rollout replicas then pull the version
    when they need it, each paying `sync_s` (checkpoint-engine style, 3.2); the trainers do not
    wait for them."""
    return model.sync_alpha_s + sync_bytes(model, full=True) / max(num_train, 1) / hw.pcie_d2h_bw


# ------------------------------------------------------------------------- resize op costs

COMM_REUSE_S = 0.05  # switch to a cached, warm communicator (3.1: reuse/split <= 0.15 s) [D]
GROUP_PREWARM_S = 0.15  # create one group off the critical path (3.1: ncclCommSplit 0.15 s)
ROUTER_S = 0.01  # [A] a control-plane message
# migrate_requests: abort the leaving engine's in-flight requests and re-queue them at the router
# with their sample ids and seeds (with their prefix under partial rollout): two control-plane
# messages (2 x ROUTER_S) and the end of the engine's current iteration (one decode step, ~8-30 ms
# for 7B) [A]. At a one-step-off boundary nothing is in flight and only the messages remain. The
# moved requests' re-prefill and decode are not here: they land on the receiving replicas as
# rollout work (the streaming simulator times them there, `sim.stream_resize`).
MIGRATE_S = 0.05
FREE_TRAIN_MEMORY_S = 0.1  # [A]


def base_read_s(model: ModelPreset, num_train: int, hw: Hardware) -> float:
    """LoRA: a trainer at training size `num_train` reading its rows of the base from the model
    folder (bf16) into device memory. The folder is taken to be in the host's page cache after
    its first read [A] (a 7B folder is 15 GB), so the read runs at the PCIe H2D rate (5 [V])."""
    return BASE_FOLDER_BYTES_PER_PARAM * model.num_params / max(num_train, 1) / hw.pcie_h2d_bw


def _shard_cost(state: str, layout: str):
    """A transfer of a shard of `state` (fp32 master weights or Adam m and v) of the trainable
    parameters (with LoRA, the adapter's): it leaves from the old layout's share (moving out) or
    lands in the new one's (joining), on the NIC. With LoRA the parameter op also waits for the
    trainers of the new layout to read their rows of the base from the model folder (seconds,
    not bytes moved: the base never crosses the network)."""
    def cost(model: ModelPreset, n_old: int, n_new: int, hw: Hardware) -> tuple[float, float]:
        total = (4.0 if state == "master" else 8.0) * model.trainable_params
        b = total / (n_old if layout == "old" else n_new)
        base = base_read_s(model, n_new, hw) if model.lora_rank and state == "master" else 0.0
        return b / hw.nic_bw + base, b
    return cost


def _fixed(seconds: Callable[[ModelPreset], float]):
    return lambda model, n_old, n_new, hw: (seconds(model), 0.0)


# (seconds, bytes) of each op the planner names, on one moving device: exactly the names of
# control.planner.OP_NAMES (a test checks both directions).
OP_COSTS: dict[str, Callable[[ModelPreset, int, int, Hardware], tuple[float, float]]] = {
    "drop_from_train_group": _fixed(lambda m: COMM_REUSE_S),
    "join_train_group": _fixed(lambda m: COMM_REUSE_S),
    "move_param_shards": _shard_cost("master", "old"),
    "receive_param_shards": _shard_cost("master", "new"),
    "move_optimizer_shards": _shard_cost("moments", "old"),
    "receive_optimizer_shards": _shard_cost("moments", "new"),
    # Wake a sleeping engine; full weights ride the regular post-step weight sync (3.3), which with
    # delta sync is a full one for the joining engine: the move pays the difference (0 with full sync).
    "load_weights": _fixed(lambda m: m.engine_wake_s + sync_s(m, full=True) - sync_s(m)),
    "alloc_kv_cache": _fixed(lambda m: m.kv_alloc_s),
    "add_to_router": _fixed(lambda m: ROUTER_S),
    "stop_routing": _fixed(lambda m: ROUTER_S),
    "migrate_requests": _fixed(lambda m: MIGRATE_S),
    "release_engine_memory": _fixed(lambda m: m.engine_release_s),
    "free_train_memory": _fixed(lambda m: FREE_TRAIN_MEMORY_S),
    "prewarm_groups": _fixed(lambda m: GROUP_PREWARM_S * 2),  # the two most likely next splits
}


def op_cost(name: str, model: ModelPreset, *, num_train_before: int, num_train_after: int,
            num_moving: int, hw: Hardware = Hardware()) -> tuple[float, float]:
    """(seconds, bytes) of one op on one moving device. Unknown names are a ValueError.

    Training state is sharded evenly over the training devices (FSDP / ZeRO-3): a leaving
    device sends its shard (fp32 master weights are critical, the Adam moments background); a
    joining device receives its new share. Transfers use the device's own NIC (47 GB/s).
    """
    if name not in OP_COSTS:
        raise ValueError(f"unknown op {name!r}")
    return OP_COSTS[name](model, max(num_train_before, 1), max(num_train_after, 1), hw)


@dataclass(frozen=True, kw_only=True)
class ResizeCost:
    critical_s: float
    background_s: float
    bytes_moved: float

    @property
    def total_s(self) -> float:
        return self.critical_s + self.background_s


def naive_resize_cost(model: ModelPreset, num_devices: int, hw: Hardware = Hardware(),
                      storage_bw_per_node: float = 5 * GB) -> ResizeCost:
    """What elastic training does today: checkpoint, tear down, new world, reload, cold engines.

    Storage bandwidth per node is an assumption [A]; world creation 0.3 + 0.01 * N s (7.3 table,
    3.1); engine cold start (3.3). Everything is on the critical path. With LoRA the checkpoint
    is the adapter's state, and the new trainers also read the base (bf16) from the model folder.
    """
    nodes = max(1, math.ceil(num_devices / hw.devices_per_node))
    ckpt_bytes = model.train_state_bytes
    save_s = ckpt_bytes / (nodes * storage_bw_per_node)
    base = BASE_FOLDER_BYTES_PER_PARAM * model.num_params if model.lora_rank else 0.0
    load_s = (ckpt_bytes + base) / (nodes * storage_bw_per_node)
    world_s = 0.3 + 0.01 * num_devices
    return ResizeCost(critical_s=save_s + world_s + load_s + model.engine_cold_start_s,
                      background_s=0.0, bytes_moved=2 * ckpt_bytes + base)
