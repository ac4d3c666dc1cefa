"""What every trainer of a run agrees on, and the policy's module before it holds weights.

`TrainerSpec` (model, optimizer settings, compute dtype, deterministic mode, whether a frozen
reference model is held, the LoRA adapter if `train.lora`: roles/lora_model.py), the state kinds a trainer holds and moves in a reshard
(`STATE_KINDS`, `REF_KIND`), and the model built with its parameters on the meta device
(`empty_model`, `param_shapes`): the skeleton that `roles.train_fsdp.FSDPTrainer` shards, and
the shapes the driver plans reshards with, without reading or initialising a weight.

Imports torch and transformers, not Ray.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from dynaresize.config import LoraConfig, ModelConfig
from dynaresize.roles.base import checkpointing, compute_dtype
from dynaresize.roles.train_state import OptimSettings

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
STATE_KINDS = ("param", *MOMENT_KINDS)
REF_KIND = "ref"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """What every trainer of a run agrees on."""

    model: ModelConfig
    optim: OptimSettings
    compute_dtype: str = "fp32"  # fp32 | bf16
    deterministic: bool = False
    activation_checkpointing: bool = False
    with_ref: bool = False  # the KL needs the reference policy (with LoRA: the base, adapter disabled)
    seed: int = 0
    lora: LoraConfig | None = None  # train only this adapter (roles/lora_model.py)

    def __post_init__(self) -> None:
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r}: must be fp32 or bf16")
        if self.deterministic and self.compute_dtype != "fp32":
            raise ValueError("deterministic mode needs compute_dtype fp32")

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float64 if self.deterministic else torch.float32

    @classmethod
    def from_config(cls, cfg: Any, *, cuda: bool = False) -> "TrainerSpec":
        """The spec of a run (`config.RunConfig`) on a CUDA device or not: schedule over the
        run's steps, `train.dtype` and `train.activation_checkpointing` resolved."""
        t = cfg.train
        optim = OptimSettings.from_config(t, schedule=t.lr_schedule, total_steps=cfg.steps)
        return cls(model=cfg.model, optim=optim, compute_dtype=compute_dtype(cfg, cuda=cuda),
                   deterministic=cfg.deterministic, activation_checkpointing=checkpointing(cfg, cuda=cuda),
                   with_ref=t.kl_coef > 0, seed=cfg.seed, lora=t.lora)

    @property
    def holds_ref(self) -> bool:
        """A second, frozen copy of the policy is held (and moved): not with LoRA, whose
        reference is the base the trainer holds anyway (peft's adapter disabled)."""
        return self.with_ref and self.lora is None

    def kinds(self) -> tuple[str, ...]:
        """State kinds a trainer holds (the reshard moves all of them): with LoRA, of the adapter."""
        return STATE_KINDS + ((REF_KIND,) if self.holds_ref else ())

    def dtype_of(self, kind: str) -> torch.dtype:
        return torch.float32 if kind == REF_KIND else self.master_dtype


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Build a module with its parameters on the meta device and its buffers real (rotary
    tables and the like are computed at construction and must survive `to_empty`)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def empty_model(model_cfg: ModelConfig) -> nn.Module:
    """The policy's module with parameters on meta (no weights read or initialised)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dynaresize.rl.models import qwen2_config

    hf_cfg = AutoConfig.from_pretrained(model_cfg.path) if model_cfg.path else qwen2_config(model_cfg)
    hf_cfg._attn_implementation = "sdpa"
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    return model


def param_shapes(model_cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters in flattening order (tied weights once; with
    `train.lora`, roles/lora_model.py `trainable_specs` gives the adapter's)."""
    return [tuple(p.shape) for p in empty_model(model_cfg).parameters()]
