"""Cost model: model presets on H100-class nodes (and named H200 / A100 devices), stage-time
constants and resize op costs.

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
from dynaresize.errors import ConfigError

GB = 1e9
# Share of a bf16 model's values that change in one RL step (lr 1e-6 .. 1e-5): about 1-3% in
# verl's delta sync measurements (3.2, github.com/verl-project/verl/pull/6974); a run that
# measures its own (`changed_fraction` of its weight_sync records) replaces it.
DEFAULT_CHANGED_FRACTION = 0.02
# LoRA: the trainers keep the frozen base in fp32 beside the adapter (roles/lora_model.py fills
# the wrapped model's rows as fp32, `fill_shards`), sharded like every parameter.
FROZEN_BASE_BYTES_PER_PARAM = 4.0
# LoRA: a trainer built at a new training size reads its rows of the base from the model folder
# (bf16 on disk) on its own host (roles/lora_model.py `LoraRows`: a base never moves).
BASE_FOLDER_BYTES_PER_PARAM = 2.0


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator in an 8-device node with one NIC per device. The defaults are an H100
    SXM 80 GB with a 400 Gb/s NDR NIC; `HARDWARE_PRESETS` names the others."""

    name: str = "h100"
    hbm_bytes: float = 80 * GB  # H100 SXM (5)
    hbm_bw: float = 3.35e12  # H100 SXM HBM3 (5, [S])
    peak_flops: float = 989e12  # bf16 dense (vendor spec, [S])
    nic_bw: float = 47 * GB  # NCCL over one NDR NIC: 46-48 GB/s (5, [V])
    pcie_h2d_bw: float = 35 * GB  # nvbandwidth H2D (5, [V])
    pcie_d2h_bw: float = 53 * GB  # nvbandwidth D2H (5, [V])
    # NVLink 4 per direction (900 GB/s bidirectional, 5 [V]). Recorded, not read by the op costs:
    # they send shards over the NIC, the path between nodes (within one node, an upper bound).
    nvlink_bw: float = 450 * GB
    devices_per_node: int = 8


# Named accelerators (`--emulate ACCEL:MODEL`). Vendor figures are spec-sheet numbers [S]; the
# achieved NIC and PCIe rates of the other parts are derived [D] by the ratios measured on H100
# (NCCL 47 of 50 GB/s per NDR NIC; H2D 35 and D2H 53 of 63 GB/s over PCIe Gen5, docs/references.md 5).
HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware(),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s (references 5, spec pages [S]);
    # same node fabric (the MLCommons H200 system lists 400 Gb/s IB per GPU, references 5 [V]).
    "h200": Hardware(name="h200", hbm_bytes=141 * GB, hbm_bw=4.8e12),
    # A100 SXM4 80 GB: HBM2e at 2.039 TB/s, 312 TFLOPS bf16 dense, PCIe Gen4 32 GB/s per direction
    # (NVIDIA A100 datasheet [S]); one 200 Gb/s HDR NIC per GPU as in DGX A100 (NVIDIA DGX A100
    # datasheet [S]): 25 GB/s nominal, 23.5 achieved [D]; PCIe 32 x 35/63 = 17.8 H2D, 32 x 53/63
    # = 26.9 D2H [D].
    "a100": Hardware(name="a100", hbm_bytes=80 * GB, hbm_bw=2.039e12, peak_flops=312e12, nic_bw=23.5 * GB,
                     pcie_h2d_bw=17.8 * GB, pcie_d2h_bw=26.9 * GB, nvlink_bw=300 * GB),
    # H20 (HGX H20, the paper's part, arXiv 2607.22614): 96 GB HBM3 at 4.0 TB/s; 148 TFLOPS FP16/BF16
    # dense (296 FP8); NVLink 4 at 900 GB/s bidirectional; PCIe Gen5 x16 (NVIDIA's HGX H20
    # figures as published in secondary sources [S]: NVIDIA's own datasheet was not readable here).
    # NIC: one 400 Gb/s NDR port per GPU as in HGX H100 systems [A] (47 GB/s achieved, 5 [V]);
    # PCIe achieved rates as the H100's (same Gen5 x16 link, 5 [V]).
    "h20": Hardware(name="h20", hbm_bytes=96 * GB, hbm_bw=4.0e12, peak_flops=148e12),
}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ConfigError([f"accelerator={name!r}: unknown (known: {', '.join(HARDWARE_PRESETS)})"]) from None


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A dense decoder model as the simulator sees it."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int = 128
    num_heads: int = 0  # attention (query) heads; 0: not recorded (only the KV heads size the cache)
    vocab_size: int = 0  # 0: not recorded (num_params already counts the embeddings)
    intermediate_size: int = 0  # the MLP's width; 0: not recorded (a LoRA adapter's size needs it)
    rollout_tp: int = 1  # devices per rollout replica = the move unit (5: TP1 / TP2 / TP4)
    decode_eff: float = 1.7  # real TPOT is 1.5-2x the weight-read bound (5, [D])
    mfu_decode: float = 0.5  # [A] compute efficiency of a decode batch
    mfu_prefill: float = 0.5  # [A]
    mfu_train: float = 0.4  # MFU 0.3-0.5 (7.3, [A])
    old_logprob_frac: float = 1.0 / 3.0  # forward-only pass, 2N of 6N FLOPs ([D]; 2.4 measures 0.25-0.5)
    train_comm_s: float = 1.0  # exposed FSDP / optimizer time per step that does not shrink with devices [A]
    max_num_seqs: int = 256  # vLLM default batch cap ([V] vLLM docs)
    kv_reserve_frac: float = 0.1  # HBM kept free for activations and fragmentation (gpu_memory_utilization 0.9)
    sync_alpha_s: float = 0.5  # control plane and pause of a weight sync (3.2: 0.1-5 s)
    sync_bw: float = 20 * GB  # tuned weight-sync bandwidth per receiver (3.2: 14-23 GB/s for verl / SGLang)
    weight_sync: str = "full"  # full | delta: what a step's sync sends (rollout.weight_sync; roles/delta_sync.py)
    sync_changed_fraction: float = DEFAULT_CHANGED_FRACTION  # delta: share of values a step changes (3.2)
    engine_wake_s: float = 0.5  # sleep -> wake of a warm engine incl. weights resident on host (3.3: 0.26-0.82 s)
    kv_alloc_s: float = 0.3  # allocate KV blocks; CUDA graphs kept (3.3) [A]
    engine_release_s: float = 0.5  # sleep level 2 (3.3: 0.74 s [U])
    engine_cold_start_s: float = 40.0  # vLLM cold start (7.3 table: 40 / 90 / 200 s; 3.3)
    lora_rank: int = 0  # train.lora's rank; 0: full training (every weight trains)
    lora_targets: tuple[str, ...] = (lora_math.ALL_LINEAR,)  # train.lora's target_modules

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.num_params  # bf16

    @property
    def decoder_shape(self) -> lora_math.DecoderShape:
        if not (self.num_heads and self.intermediate_size):
            raise ConfigError([f"model={self.name!r}: its preset records no num_heads / intermediate_size, "
                               "which a LoRA adapter's size needs"])
        return lora_math.DecoderShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                                      num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                      head_dim=self.head_dim, intermediate_size=self.intermediate_size)

    @property
    def adapter_params(self) -> int:
        """The LoRA adapter's parameters (0 for full training)."""
        return lora_math.adapter_params(self.decoder_shape, self.lora_rank, self.lora_targets) if self.lora_rank else 0

    @property
    def trainable_params(self) -> float:
        """What the optimizer updates, and what a move's shards carry: the adapter, or every weight."""
        return float(self.adapter_params) if self.lora_rank else self.num_params

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * 2.0  # K and V, bf16

    @property
    def train_state_bytes(self) -> float:
        """What a checkpoint holds: fp32 master, fp32 gradients, two fp32 moments (costmodel.memory)
        of the trainable parameters (with LoRA, the adapter's only)."""
        return memory.train_state_bytes(self.trainable_params)

    @property
    def trainer_held_bytes(self) -> float:
        """All trainers' device bytes of state: the trainable state, plus with LoRA the frozen base
        (fp32, `FROZEN_BASE_BYTES_PER_PARAM`), which is also the reference model."""
        extra = FROZEN_BASE_BYTES_PER_PARAM * self.num_params if self.lora_rank else 0.0
        return self.train_state_bytes + extra


def _preset_7b() -> ModelPreset:
    # Qwen2.5-7B: 7.62e9 params, 28 layers, hidden 3584, 4 KV heads (5: Qwen2.5-7B, 7.62e9 parameters).
    # Attention 28 heads, MLP 18944 (its config.json, as Qwen2-7B's; used by a LoRA adapter's size).
    return ModelPreset(name="7b", num_params=7.62e9, num_layers=28, hidden_size=3584, num_kv_heads=4,
                       num_heads=28, intermediate_size=18944, rollout_tp=1, train_comm_s=1.0, engine_wake_s=0.5, kv_alloc_s=0.3,
                       engine_release_s=0.5, engine_cold_start_s=40.0)


def _preset_32b() -> ModelPreset:
    # Qwen2.5-32B: 32.8e9 params, 64 layers, hidden 5120, 8 KV heads; rollout TP2 (5).
    # Attention 40 heads, MLP 27648 (its config.json).
    return ModelPreset(name="32b", num_params=32.8e9, num_layers=64, hidden_size=5120, num_kv_heads=8,
                       num_heads=40, intermediate_size=27648, rollout_tp=2, train_comm_s=3.0, engine_wake_s=1.0, kv_alloc_s=0.5,
                       engine_release_s=1.0, engine_cold_start_s=90.0)


def _preset_70b() -> ModelPreset:
    # Llama-3.1-70B-class: 70.6e9 params, 80 layers, hidden 8192, 8 KV heads; rollout TP4 (5).
    # Attention 64 heads, MLP 28672 (Llama-3.1-70B's config.json).
    return ModelPreset(name="70b", num_params=70.6e9, num_layers=80, hidden_size=8192, num_kv_heads=8,
                       num_heads=64, intermediate_size=28672, rollout_tp=4, train_comm_s=6.0, engine_wake_s=2.0, kv_alloc_s=1.0,
                       engine_release_s=2.0, engine_cold_start_s=200.0)


def _preset_qwen3_8b() -> ModelPreset:
    # Qwen3-8B, the paper's model (arXiv 2607.22614). From its Hugging Face config.json (Qwen/Qwen3-8B
    # [V], as copied in public code): hidden_size 4096, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, intermediate_size 12288, untied embeddings.
    # Parameters 8.19e9 [D] from those (2 x 151936 x 4096 embedding + 36 x 192.9e6 per layer); the
    # model card says 8.2B (6.95B without embeddings). Rollout TP1: verl's Qwen3-8B DAPO recipe runs
    # gen_tp=1 (recipe/dapo/test_dapo_8b_megatron_fp16.sh). Engine and communication times as the 7b's [A].
    return ModelPreset(name="qwen3-8b", num_params=8.19e9, num_layers=36, hidden_size=4096, num_kv_heads=8,
                       head_dim=128, num_heads=32, vocab_size=151936, intermediate_size=12288, rollout_tp=1, train_comm_s=1.0,
                       engine_wake_s=0.5, kv_alloc_s=0.3, engine_release_s=0.5, engine_cold_start_s=40.0)


MODEL_PRESETS = {"7b": _preset_7b, "32b": _preset_32b, "70b": _preset_70b, "qwen3-8b": _preset_qwen3_8b}


def get_model(name: str) -> ModelPreset:
    try:
        return MODEL_PRESETS[name]()
    except KeyError:
        raise ConfigError([f"model={name!r}: unknown (known: {', '.join(MODEL_PRESETS)})"]) from None


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
