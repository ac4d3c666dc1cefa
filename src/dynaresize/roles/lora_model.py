"""`train.lora` on the trainers and in the export: the policy wrapped by peft, the adapter as the
trainer state, and the names that cross the wire (roles/lora.py).

- `wrap`: peft's `get_peft_model` with the run's `LoraConfig` (rank, alpha, dropout, target
  modules); the base weights are frozen, only the adapter's `lora_A`/`lora_B` train.
- `adapter_specs`: (wire name, shape) of every adapter tensor in the wrapped model's parameter
  order (built on meta: nothing read). This is what the trainers' state kinds, the reshard
  layout, snapshots, checkpoints and the weight sync are made of with LoRA on: the adapter
  and its moments only. peft's names become wire names by dropping `base_model.model.` and
  `.default.weight` (`wire_name`).
- `initial_adapter`: the adapter at step 0, a function of (specs, run seed) alone, so every
  trainer, every engine and a device joining later agree: `lora_A` as peft initialises it
  (kaiming-uniform, a = sqrt(5)) from a generator seeded by the run seed, `lora_B` zero (so
  the policy starts as the base).
- `LoraRows`: the rows of the wrapped model's parameters for `initial_weights.fill_shards`:
  base rows from the model folder or the initial weights every time a trainer is built (a
  base never moves), read from the process's kept `shared_initial_weights` (the built-in model
  is initialised once per process, at start, not on a move's critical path), adapter rows from
  `initial_adapter` (or none: a trainer built for a reshard or restore gets its adapter from
  there).
- `merged_state` / `save_adapter`: the HF export (the merged model, `AdapterMerge`'s arithmetic)
  and the adapter in peft's layout (adapter_model.safetensors, adapter_config.json).

Imports torch, transformers and peft, not Ray.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from dynaresize.config import ALL_LINEAR, LoraConfig, ModelConfig
from dynaresize.roles.lora import LORA_HALVES, AdapterMerge

PEFT_PREFIX = "base_model.model."
ADAPTER_DIR = "adapter"  # the export's adapter folder (beside config.json, not in it: transformers would
# then load the folder as an adapter of `base_model_name_or_path`)


def peft_config(lora: LoraConfig) -> Any:
    import peft

    targets = ALL_LINEAR if tuple(lora.target_modules) == (ALL_LINEAR,) else list(lora.target_modules)
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)


def wrap(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` wrapped by peft with the run's adapter (base frozen, adapter trainable)."""
    import peft

    try:
        return peft.get_peft_model(model, peft_config(lora))
    except ValueError as exc:  # target modules that match nothing, a module type peft cannot adapt
        from dynaresize.errors import ConfigError

        first = (str(exc).strip().splitlines() or ["no message"])[0]
        raise ConfigError([f"train.lora.target_modules={','.join(lora.target_modules)!r}: {first}"]) from None


def wire_name(peft_name: str) -> str | None:
    """The wire name (roles/lora.py) of an adapter parameter of the wrapped model; None for a base one."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    for half in LORA_HALVES:
        tail = f".{half}.default.weight"
        if name.endswith(tail):
            return name[: -len(tail)] + f".{half}"
    return None


def base_name(peft_name: str) -> str:
    """The HF name of a base parameter of the wrapped model (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


@functools.lru_cache(maxsize=8)
def adapter_specs(model_cfg: ModelConfig, lora: LoraConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(wire name, shape) of the adapter's tensors, in the wrapped model's parameter order."""
    from dynaresize.roles.train_spec import empty_model

    model = wrap(empty_model(model_cfg), lora)
    specs = tuple((w, tuple(p.shape)) for n, p in model.named_parameters() if (w := wire_name(n)) is not None)
    base = {base_name(n): tuple(p.shape) for n, p in model.named_parameters() if wire_name(n) is None}
    halves = dict(specs)
    for name, shape in specs:  # each adapter must merge into one [out, in] weight (roles/lora.py)
        module, _, half = name.rpartition(".")
        if half == "lora_A" and base.get(f"{module}.weight") != (halves.get(f"{module}.lora_B", (0,))[0], shape[1]):
            from dynaresize.errors import ConfigError

            raise ConfigError([f"train.lora.target_modules={','.join(lora.target_modules)!r}: peft adapts "
                               f"{module.removesuffix('.base_layer')} ({type(model.get_submodule(PEFT_PREFIX + module)).__name__}"
                               f", not one linear weight: fused experts), which a LoRA sync cannot merge; name the "
                               "linear layers to adapt instead (e.g. q_proj,k_proj,v_proj,o_proj)"])
    return specs


def trainable_specs(model_cfg: ModelConfig, lora: LoraConfig | None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of what the trainers train, in flattening order: every parameter (tied
    weights once), or with `lora` the adapter's tensors by wire name."""
    if lora is not None:
        return list(adapter_specs(model_cfg, lora))
    from dynaresize.roles.train_spec import empty_model

    return [(n, tuple(p.shape)) for n, p in empty_model(model_cfg).named_parameters()]


def initial_adapter(specs: Any, seed: int) -> dict[str, torch.Tensor]:
    """The step-0 adapter (module docstring): fp32, by wire name, in `specs`' order."""
    gen = torch.Generator().manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for name, shape in specs:
        t = torch.zeros(shape, dtype=torch.float32)
        if name.endswith(".lora_A"):  # nn.init.kaiming_uniform_(a=sqrt(5)): bound 1/sqrt(fan_in)
            bound = 1.0 / math.sqrt(shape[1])
            t.uniform_(-bound, bound, generator=gen)
        out[name] = t
    return out


class LoraRows:
    """Rows of the wrapped model's parameters by peft name (for `fill_shards`); None for an
    adapter row when no adapter is given (it comes from a reshard or a restore)."""

    def __init__(self, base: Any, adapter: Mapping[str, torch.Tensor] | None) -> None:
        self.base = base  # InitialWeights (or anything with rows(hf_name, lo, hi))
        self.adapter = adapter

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor | None:
        wire = wire_name(name)
        if wire is None:
            return self.base.rows(base_name(name), lo, hi)
        return None if self.adapter is None else self.adapter[wire][lo:hi].clone()


class ModuleRows:
    """Rows of a whole module's parameters (a trainer given a full initial model)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {n: p.detach() for n, p in module.named_parameters()}

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.params[name][lo:hi].to(torch.float32).clone()


def trainer_rows(spec: Any, init_model: Any) -> LoraRows:
    """What a LoRA trainer (roles/train_fsdp.py) fills its shards from: the base from
    `init_model` (`InitialWeights`, a whole module, or None: the run's initial weights) and
    the step-0 adapter when `init_model` is given (None: the adapter comes from a reshard or
    a restore)."""
    from dynaresize.roles.initial_weights import InitialWeights, shared_initial_weights

    if init_model is None:  # a rebuild (a move, a recovery, a resume): the process's kept base, read not rebuilt
        return LoraRows(shared_initial_weights(spec.model), None)
    if isinstance(init_model, nn.Module):
        base: Any = ModuleRows(init_model)
    elif isinstance(init_model, InitialWeights) and init_model.model_cfg == spec.model:
        base = shared_initial_weights(spec.model).warm()  # the same rows; kept for the rebuilds to come
    else:
        base = init_model
    return LoraRows(base, initial_adapter(adapter_specs(spec.model, spec.lora), spec.seed))


def merged_state(model_cfg: ModelConfig, lora: LoraConfig, adapter: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The base's parameters (as `build_model` holds them) with every adapted module merged
    (`AdapterMerge`: base + alpha/r B@A in fp32, cast to `dtype`), by HF name."""
    from dynaresize.rl.models import build_model

    base = {n: p.detach() for n, p in build_model(model_cfg).named_parameters()}
    merge = AdapterMerge(rank=lora.rank, alpha=lora.alpha, dtype=dtype, read_base=base.__getitem__)
    out = {n: t.to(dtype) for n, t in base.items()}
    out.update(merge.feed(adapter.items()))
    if merge.pending():
        raise RuntimeError(f"LoRA export: adapter halves missing for {merge.pending()[:4]}")
    return out


def save_adapter(model_cfg: ModelConfig, lora: LoraConfig, adapter: Mapping[str, torch.Tensor],
                 directory: str | Path) -> Path:
    """The adapter in peft's layout (adapter_model.safetensors under peft's key names,
    adapter_config.json) in `directory/adapter`, written from the tensors alone (no second model
    built): `PeftModel.from_pretrained(base, that folder)` loads it."""
    from safetensors.torch import save_file

    out = Path(directory) / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora)
    config.base_model_name_or_path = model_cfg.path
    config.save_pretrained(str(out))
    tensors = {f"{PEFT_PREFIX}{name}.weight": t.detach().to("cpu", torch.float32).contiguous()
               for name, t in adapter.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def export_model(model_cfg: ModelConfig, lora: LoraConfig | None, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """The HF model an export writes from the trainers' full weights (`full_params`): those
    weights, or with LoRA the base with the adapter merged (`merged_state`)."""
    from dynaresize.rl.models import build_model, complete_state_dict

    model = build_model(model_cfg)
    state = merged_state(model_cfg, lora, weights) if lora is not None else weights
    model.load_state_dict(complete_state_dict(state, model), strict=True)
    return model


def save_export(model_cfg: ModelConfig, lora: LoraConfig | None, weights: Mapping[str, torch.Tensor],
                directory: str | Path) -> None:
    """The HF export folder: config.json and model.safetensors (merged with LoRA), and with
    LoRA the adapter in peft's layout in `adapter/` (`save_adapter`)."""
    from dynaresize.rl.models import save_hf

    model = export_model(model_cfg, lora, weights)
    # transformers 5 writes only on world rank 0 once torch.distributed is initialised (it
    # assumes every rank saves the same model); the caller is the one writer, whatever its rank
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    save_hf(model, None, directory)
    if lora is not None:
        save_adapter(model_cfg, lora, weights, directory)
