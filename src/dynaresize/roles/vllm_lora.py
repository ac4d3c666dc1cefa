"""The vLLM engine's side of a LoRA run (`train.lora`): it is sent the adapter (roles/lora.py's
wire names, `m.lora_A` / `m.lora_B`) and serves the merged weights.

Why merged, not vLLM's own LoRA: the CPU build does run adapters (`enable_lora`, measured on a
tiny Llama: greedy tokens equal peft's merged model), but only from a folder on disk
(`LoRARequest.lora_path`; loading from tensors means patching vLLM's private worker manager, as
verl does), its ranks are limited to vLLM's list (1, 8, 16, 32, ...), every request must carry
the adapter, and it wraps the targeted layers, which changes the module tree the engine's
read-back, digest, TP gather and start-time name check walk. The merge is the HF engine's (one
rule, `lora.merged_weight`), deterministic, and reuses the engine's in-place load.

How: the engine starts from the model folder's own weights (`load_format="auto"`: the base,
never sent; the built-in model's are written to its temporary folder first). A sync's adapter
goes through `lora.AdapterMerge` (each targeted base weight read once by HF name, as the
trainers read theirs: `initial_weights`, the folder's safetensors rows in fp32, or the built-in
model's init; kept in fp32 on the host) and the merged weights
are loaded in place, module by module: vLLM reloads a module once all its weights arrived, so
each merged weight goes with the rest of its vLLM module (q/k/v of a layer and their biases,
gate/up), the untargeted parts from the base (`engine_group`); untouched modules keep theirs.

Invariants: every sync merges from the folder's base (never from the served weights: no error
accumulates, a second adapter replaces the first); a vLLM module is loaded at most once per
sync; a sync ends with no half-received adapter; `digest` is of the adapter applied last, in
the engine's dtype (what the trainers' digest covers under LoRA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from dynaresize.errors import UserError
from dynaresize.roles.lora import AdapterMerge, merged_weight, parse_adapter_name

Chunk = list[tuple[str, Any]]


def engine_group(weight: str, packed: Mapping[str, Iterable[str]], shapes: Mapping[str, Any]) -> tuple[str, ...]:
    """The HF weight names vLLM loads as one module with `weight` (`m.weight`): q/k/v or
    gate/up of its layer when vLLM packs them (`packed_modules_mapping`), each with its bias,
    else `m`'s weight and bias; only names the engine holds (`shapes`)."""
    module = weight.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    subs = next((list(v) for v in packed.values() if leaf in v), [leaf])
    pre = f"{parent}." if parent else ""
    return tuple(n for s in subs for n in (f"{pre}{s}.weight", f"{pre}{s}.bias") if n in shapes)


def is_adapter(weights: Mapping[str, Any] | Iterable[Chunk]) -> tuple[bool, Mapping[str, Any] | Iterable[Chunk]]:
    """(whether `weights` is an adapter, the same weights): a stream's first chunk is looked at
    and put back. Every name of it must be an adapter's, or none (full weights)."""
    if isinstance(weights, Mapping):
        names, rest = list(weights), weights
    else:
        it = iter(weights)
        first = next(it, [])
        names = [n for n, _ in first]

        def rest_stream() -> Iterator[Chunk]:
            yield first
            yield from it
        rest = rest_stream()
    flags = {parse_adapter_name(n) is not None for n in names}
    if len(flags) > 1:
        raise RuntimeError("a weight sync mixed adapter tensors with full weights: a LoRA engine takes one kind")
    return flags == {True}, rest


class EngineLora:
    """One vLLM engine's LoRA state: the merge (base kept, last adapter) and how vLLM packs its
    modules. `read_base(name)`: a base weight; `shapes`: the engine's weights by HF name;
    `packed`: vLLM's packed_modules_mapping."""

    def __init__(self, *, rank: int, alpha: float, dtype: torch.dtype, read_base: Callable[[str], torch.Tensor],
                 shapes: Mapping[str, tuple[int, ...]], packed: Mapping[str, Iterable[str]]) -> None:
        self.merge = AdapterMerge(rank=rank, alpha=alpha, dtype=dtype, read_base=read_base)
        self.dtype, self.shapes, self.packed = dtype, dict(shapes), {k: list(v) for k, v in packed.items()}
        self.applied = False  # an adapter was loaded (else the engine serves the folder's base)

    def merged_items(self, chunks: Iterable[Chunk]) -> Iterator[tuple[str, torch.Tensor]]:
        """The (HF name, weight) pairs to reload for a sync's adapter chunks: each merged weight
        with the rest of its vLLM module, a module only once its adapters' halves all arrived.
        A chunk is emptied once fed (its buffer can go)."""
        fresh: dict[str, torch.Tensor] = {}
        waiting: list[tuple[str, ...]] = []
        done: set[tuple[str, ...]] = set()
        for chunk in chunks:
            for name, weight in self.merge.feed(chunk):
                if name not in self.shapes or tuple(weight.shape) != tuple(self.shapes[name]):
                    raise UserError(f"train.lora: the vLLM engine has no linear weight {name} of shape "
                                    f"{tuple(weight.shape)} to merge the adapter into (target_modules)")
                fresh[name] = weight
                group = engine_group(name, self.packed, self.shapes)
                if group in done:
                    raise RuntimeError(f"LoRA sync: the vLLM module of {name} was completed twice in one sync")
                if group not in waiting:
                    waiting.append(group)
            chunk.clear()
            pending = {f"{m}.weight" for m in self.merge.pending()}
            for group in [g for g in waiting if not pending.intersection(g)]:
                waiting.remove(group)
                done.add(group)
                yield from ((n, fresh.pop(n) if n in fresh else self._served(n)) for n in group)
        if self.merge.pending():
            raise RuntimeError(f"LoRA sync ended with half an adapter for {self.merge.pending()[:3]}")
        self.applied = True

    def _served(self, name: str) -> torch.Tensor:
        """A module part not merged in this sync: its last adapter's merge, else the base."""
        module = name.rsplit(".", 1)[0]
        a, b = self.merge.adapter.get(f"{module}.lora_A"), self.merge.adapter.get(f"{module}.lora_B")
        base = self.merge.base(name)
        if a is None or b is None or not name.endswith(".weight"):
            return base.to(self.dtype)
        return merged_weight(base, a, b, self.merge.scale, self.dtype)

    def digest(self, names: Iterable[str] | None, dtype: torch.dtype) -> str:
        """`weight_sync.weights_digest` of the adapter applied last (`names`: wire names)."""
        from dynaresize.roles.weight_sync import weights_digest

        if not self.applied:
            raise RuntimeError("the vLLM engine has no LoRA adapter applied yet (it serves the folder's base)")
        return weights_digest(self.merge.named_adapter(None if names is None else list(names)), dtype)


def policy_shapes(model_cfg: Any) -> dict[str, torch.Tensor]:
    """The policy's weights as meta tensors (names and shapes, nothing read): what a LoRA
    engine's start checks vLLM's mapping against (engine_map.check_start), as a full-weight
    start checks the state dict it is given."""
    from dynaresize.roles.initial_weights import initial_weights

    return {n: torch.empty(s, device="meta") for n, s in initial_weights(model_cfg).shapes.items()}


def save_weights(model: torch.nn.Module, folder: str) -> None:
    """`model`'s weights as `folder`/model.safetensors, a tied weight once (under its first
    name: the embedding). Not `save_pretrained`: under torch.distributed it writes on rank 0
    only, and a trainer joining rollout is often another rank."""
    from safetensors.torch import save_file

    seen, state = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state[name] = t.detach().contiguous()
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})


def _rpc_packed(worker: Any) -> dict[str, list[str]]:
    return {k: list(v) for k, v in (getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {}).items()}


def _rpc_reload_part(worker: Any, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`vllm_weights._rpc_reload` of some modules only: vLLM's notice listing every weight not
    given (all the untouched ones, which keep their values) is silenced."""
    from dynaresize.roles.vllm_weights import _rpc_reload

    inplace = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    level = inplace.level
    inplace.setLevel(logging.ERROR)
    try:
        _rpc_reload(worker, items)
    finally:
        inplace.setLevel(level)


def start_lora(llm: Any, lora_cfg: Any, dtype: torch.dtype, model_cfg: Any,
               shapes: Mapping[str, tuple[int, ...]]) -> EngineLora:
    """The engine's LoRA state, once its engine started from the model's weights; the base is
    read as the trainers read theirs (`initial_weights`: nothing is read until a merge needs it)."""
    from dynaresize.roles.initial_weights import shared_initial_weights

    base = shared_initial_weights(model_cfg)  # the process's kept one: a trainer built here later reads it too
    return EngineLora(rank=int(lora_cfg.rank), alpha=float(lora_cfg.alpha), dtype=dtype, read_base=base.param,
                      shapes=shapes, packed=llm.collective_rpc(_rpc_packed)[0])


def load_adapter(llm: Any, lora: EngineLora, weights: Mapping[str, Any] | Iterable[Chunk]) -> None:
    """Merge the adapter `weights` (a state dict or a stream of chunks) and load the merged
    modules into the running engine `llm` in place (one reload call), then reset its prefix
    cache (its KV was computed with the old weights)."""
    from dynaresize.roles.vllm_weights import reset_prefix_cache
    from dynaresize.roles.weight_sync import chunks_of

    llm.collective_rpc(_rpc_reload_part, args=(lora.merged_items(chunks_of(weights)),))
    reset_prefix_cache(llm)
