"""The policy's initial weights, read a trainer's rows at a time (no worker builds the whole model).

A trainer (roles/train_fsdp.py) builds its module on the meta device (`train_spec.empty_model`),
shards it with FSDP2 and materialises only its local shards (`to_empty`), then fills them here:
`rows(name, lo, hi)` gives rows `[lo, hi)` (dim 0) of parameter `name` of the initial model, in
fp32, as `rl.models.build_model` would hold them.

- A model folder whose safetensors name every parameter (by its own name or a tied alias) with
  its shape: each call reads only those rows from the file (`safe_open(...).get_slice`), so a
  rank's host memory for weights is its shard plus one slice; a bf16 or fp16 file is cast to
  fp32 exactly as `from_pretrained(dtype=float32)` casts it. `rows_read` records what was read.
- Otherwise (the built-in tiny model, whose init is one RNG stream over the whole module, or a
  folder that transformers must convert on load: other key names, missing tensors, .bin files):
  the model is built whole once by `build_model`, as before, and sliced (`whole` says so). The
  built-in model is tiny by construction (a few to a few tens of MB), so that copy is not the
  problem this module solves; its rows are the old path's bit for bit.

Under `train.lora` (roles/lora_model.py) every trainer built for a move, a recovery or a resume
fills its frozen base rows again, on the move's critical path: `shared_initial_weights` is the
one `InitialWeights` a process keeps for that (per model config, one entry), so the base is
read, not rebuilt: a folder's safetensors stay open (mmapped: a build reads its rows from the
page cache) and the built-in model is initialised once per process and then sliced. What it
keeps in host memory: for a folder, the shapes and the open files (the pages are the OS's
cache, shared by the node's workers); for the built-in model, its fp32 weights, 4 B/param per
worker process (5 MB for the default tiny model, 168 MB for the bench's 42M one). A LoRA
trainer and engine start from it, so the first move finds it filled.

Invariant: for every parameter, the concatenation of `rows` over a partition of its rows equals
`build_model(cfg)`'s tensor bitwise (tests/dist/test_trainer_meta_init.py).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Sequence
import torch

from dynaresize.config import ModelConfig


class InitialWeights:
    """Rows of the initial parameters of `model_cfg`'s policy (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                 aliases: dict[str, str] | None = None, record: bool = True) -> None:
        """`shapes`: name -> shape of every trainable parameter; `aliases`: state-dict key ->
        the parameter it is tied to (`rl.models.tied_aliases`); `record`: keep `rows_read`
        (off for the process's long-lived one, which it would grow without bound)."""
        self.model_cfg = model_cfg
        self.shapes = dict(shapes)
        self.record = record
        self.rows_read: list[tuple[str, int, int]] = []  # (name, lo, hi) of every read
        self._open: dict[str, object] = {}  # file -> its safe_open handle (mmapped), opened on first read
        self._full: dict[str, torch.Tensor] | None = None
        self._files = _safetensors_keys(model_cfg.path) if model_cfg.path else None
        self._keys: dict[str, tuple[str, str]] = {}  # parameter -> (file, key)
        if self._files is not None:
            also = {}
            for alias, name in (aliases or {}).items():
                also.setdefault(name, []).append(alias)
            for name, shape in self.shapes.items():
                hit = next(((f, k) for k in [name, *also.get(name, [])] for f, keys in self._files.items()
                            if keys.get(k) == list(shape)), None)
                if hit is None:
                    self._keys = {}
                    break
                self._keys[name] = hit

    @classmethod
    def of(cls, model_cfg: ModelConfig, model: torch.nn.Module, *, record: bool = True) -> "InitialWeights":
        """For the parameters of `model` (a meta-device skeleton of the policy)."""
        from dynaresize.rl.models import tied_aliases

        return cls(model_cfg, {n: tuple(p.shape) for n, p in model.named_parameters()}, tied_aliases(model),
                   record=record)

    @property
    def whole(self) -> bool:
        """The model is built whole and sliced (not read row-wise from its files)."""
        return not self._keys

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows `[lo, hi)` of parameter `name`, fp32, a fresh tensor."""
        if self.record:
            self.rows_read.append((name, int(lo), int(hi)))
        if self.whole:
            return self._whole()[name][lo:hi].clone()
        from safetensors import safe_open

        file, key = self._keys[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_slice(key)[lo:hi].to(torch.float32)

    def param(self, name: str) -> torch.Tensor:
        """Parameter `name` whole, fp32 (a LoRA engine's base for a merge: roles/lora.py)."""
        if name not in self.shapes:
            raise KeyError(f"the policy has no weight {name!r} (a LoRA target's base)")
        return self.rows(name, 0, self.shapes[name][0])

    def warm(self) -> "InitialWeights":
        """Do now what the first `rows` would (the built-in model's build), off a move's path."""
        if self.whole:
            self._whole()
        return self

    def _whole(self) -> dict[str, torch.Tensor]:
        if self._full is None:
            from dynaresize.rl.models import build_model

            self._full = {n: p.detach() for n, p in build_model(self.model_cfg).named_parameters()}
        return self._full


def initial_weights(model_cfg: ModelConfig) -> InitialWeights:
    """The initial weights of `model_cfg`'s policy, for the parameters of its meta skeleton."""
    from dynaresize.roles.train_spec import empty_model

    return InitialWeights.of(model_cfg, empty_model(model_cfg))


@functools.lru_cache(maxsize=1)
def shared_initial_weights(model_cfg: ModelConfig) -> InitialWeights:
    """This process's long-lived `InitialWeights` of `model_cfg` (module docstring: what a LoRA
    trainer rebuilt for a move fills its base from; one model config kept at a time)."""
    from dynaresize.roles.train_spec import empty_model

    return InitialWeights.of(model_cfg, empty_model(model_cfg), record=False)


def _safetensors_keys(path: str | None) -> dict[str, dict[str, list[int]]] | None:
    """{file: {key: shape}} of a folder's safetensors (sharded or not); None without any."""
    if path is None:
        return None
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({str(folder / f) for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [str(folder / "model.safetensors")] if (folder / "model.safetensors").is_file() else []
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, dict[str, list[int]]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out[file] = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    return out



def fill_shards(modules: Sequence[torch.nn.Module], weights: InitialWeights, index: int, world: int) -> None:
    """Fill the local shards of FSDP2 modules (every parameter a DTensor split on dim 0: rank
    `index` of `world` holds rows [index c, (index+1) c), c = ceil(rows / world)) from `weights`,
    cast to the shard's dtype: the values sharding the full model would have given, bitwise (a
    cast of the same fp32 rows)."""
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                local, rows = p.to_local(), int(p.shape[0])
                chunk = math.ceil(rows / world)
                lo, hi = min(rows, index * chunk), min(rows, (index + 1) * chunk)
                if local.shape[0] != hi - lo:
                    raise RuntimeError(f"{name}: local shard of {local.shape[0]} rows, expected rows [{lo}, {hi})")
                part = weights.rows(name, lo, hi) if hi > lo else None
                if part is not None:  # None: a row the caller fills otherwise (a LoRA adapter: roles/lora_model.py)
                    local.copy_(part)
