"""LoRA on the wire: how an adapter crosses from the trainers to the engines, and how an
engine turns it into the weights it serves.

With `train.lora` on, the trainers train only the adapter (peft's `LoraConfig`: rank r, alpha,
dropout, target modules); the base weights stay as the model folder has them. A weight sync
then sends the adapter, never the base: for each targeted linear module `m` (its HF weight is
`m.weight`, shape [out, in]) two tensors named

    m.lora_A   [r, in]     and     m.lora_B   [out, r]

(`adapter_name`; peft calls them `...m.lora_A.default.weight`, `...m.lora_B.default.weight`).
`weight_sync.fused_unit` keeps both in one bucket, and q/k/v (gate/up) of a layer together, as
it does for the base weights.

An engine serves the merged weight, as peft's `merge_and_unload` computes it:

    m.weight = base(m.weight) + (alpha / r) * (lora_B @ lora_A)

in fp32, then cast to the engine's dtype (`merged_weight`). `AdapterMerge` holds what an engine
needs for that: the base weight of every targeted module (read once from the model folder, kept
in fp32 on the host, never sent) and the adapter it applied last (its digest in deterministic
mode is the adapter's, which is what the trainers' `full_params` yield).

Invariants: the base is never modified (every sync merges from it, so no error accumulates
over steps); a merge needs both halves of a module's adapter (a half alone is held until its
other half arrives); the merged weight is a function of (base, A, B, scale) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

LORA_HALVES = ("lora_A", "lora_B")


def lora_scale(rank: int, alpha: float) -> float:
    """peft's scaling without rsLoRA: alpha / r."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    return float(alpha) / rank


def adapter_name(module: str, half: str) -> str:
    """The wire name of one half (`lora_A` or `lora_B`) of module `module`'s adapter."""
    if half not in LORA_HALVES:
        raise ValueError(f"LoRA half must be one of {LORA_HALVES}, got {half!r}")
    return f"{module}.{half}"


def parse_adapter_name(name: str) -> tuple[str, str] | None:
    """(module, half) of a wire name, or None for a name that is not an adapter's."""
    module, dot, half = name.rpartition(".")
    return (module, half) if dot and half in LORA_HALVES else None


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """base + scale * (B @ A), computed in fp32 and cast to `dtype` (peft's merge)."""
    if lora_b.shape[1] != lora_a.shape[0] or (lora_b.shape[0], lora_a.shape[1]) != tuple(base.shape):
        raise ValueError(f"LoRA shapes do not fit: base {tuple(base.shape)}, A {tuple(lora_a.shape)}, "
                         f"B {tuple(lora_b.shape)}")
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (base.to(torch.float32) + scale * delta).to(dtype)


class AdapterMerge:
    """An engine's side of a LoRA sync (module docstring): feed it adapter tensors by wire name,
    get back (base weight name, merged weight) for each module whose two halves arrived.

    `read_base(weight_name)` returns a base weight as the model folder has it; it is called
    once per targeted module and the result kept (fp32, host)."""

    def __init__(self, *, rank: int, alpha: float, dtype: torch.dtype,
                 read_base: Callable[[str], torch.Tensor]) -> None:
        self.scale = lora_scale(rank, alpha)
        self.dtype = dtype
        self._read_base = read_base
        self._base: dict[str, torch.Tensor] = {}
        self._half: dict[str, dict[str, torch.Tensor]] = {}
        self.adapter: dict[str, torch.Tensor] = {}  # wire name -> the last applied tensor (host copy)

    def feed(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Merge what `named` completes; names that are not adapters' raise (a LoRA engine is
        sent adapters only)."""
        for name, tensor in named:
            parsed = parse_adapter_name(name)
            if parsed is None:
                raise RuntimeError(f"LoRA engine was sent {name!r}, which is not an adapter tensor")
            module, half = parsed
            self.adapter[name] = tensor.detach().to("cpu", copy=True)
            halves = self._half.setdefault(module, {})
            halves[half] = self.adapter[name]
            if len(halves) == len(LORA_HALVES):
                del self._half[module]
                yield f"{module}.weight", merged_weight(self.base(f"{module}.weight"), halves["lora_A"],
                                                        halves["lora_B"], self.scale, self.dtype)

    def base(self, weight_name: str) -> torch.Tensor:
        """The base weight `weight_name` (read once, then kept)."""
        if weight_name not in self._base:
            self._base[weight_name] = self._read_base(weight_name).detach().to("cpu", torch.float32, copy=True)
        return self._base[weight_name]

    def pending(self) -> list[str]:
        """Modules with only one half received (must be empty once a sync ends)."""
        return sorted(self._half)

    def named_adapter(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, Any]]:
        """(wire name, tensor) of the adapter applied last, in `names`' order (or received order)."""
        for n in (self.adapter if names is None else names):
            yield n, self.adapter[n]
