"""Model presets: the dense decoders the simulator and the emulator model (re-exported by `costs`).

A preset's sizes come from the model's own config.json (each cites its source); the engine and
communication times are the cost model's (docs/references.md sections, status letters as in
`costs`). `lora_rank` > 0 makes the preset a LoRA job (`costs.with_lora`): its trained
parameters are the adapter's (`costmodel.lora`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaresize.costmodel import lora as lora_math
from dynaresize.costmodel import memory
from dynaresize.costmodel.hardware import GB
from dynaresize.errors import ConfigError

# Share of a bf16 model's values that change in one RL step (lr 1e-6 .. 1e-5): about 1-3% in
# verl's delta sync measurements (3.2, github.com/verl-project/verl/pull/6974); a run that
# measures its own (`changed_fraction` of its weight_sync records) replaces it.
DEFAULT_CHANGED_FRACTION = 0.02
FROZEN_BASE_BYTES_PER_PARAM = lora_math.FROZEN_BASE_BYTES_PER_PARAM  # LoRA: the trainers' frozen base, fp32


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
