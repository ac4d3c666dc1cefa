"""A vLLM engine's routed experts (FusedMoE) under the trainer's names, read back exactly.

vLLM keeps the experts of one MoE layer stacked in two parameters of its `RoutedExperts`
module: `w13_weight` (experts, 2 x intermediate, hidden: each expert's gate rows then its up
rows) and `w2_weight` (experts, hidden, intermediate). transformers 5 holds them the same way
(`experts.gate_up_proj`, `experts.down_proj`), and vLLM's expert loader takes such stacked
tensors under the checkpoint's fused names (its `get_expert_mapping(include_fused=True)`), so
a weight sync sends the trainer's tensors as they are. `expert_names` gives those names for a
layer, from its own checkpoint projection names (gate_proj/up_proj/down_proj: Qwen-MoE style;
w1/w3/w2: Mixtral style), exactly as vLLM's mapping builds them.

Reading back (`expert_weights`): on CPU vLLM prepacks both tensors into its grouped-GEMM layout
(same shape, elements moved) and may zero-pad the intermediate size. The layout is recovered
exactly by prepacking element indices (a few probes in the weights' dtype, each one digit of
the index small enough to be exact) and checking the result is a permutation; the padding is
cut off. CUDA's Triton backends keep the tensors as loaded. Any other backend (FlashInfer, AITER, ...) reorders them in a way
this module does not invert: reading them back raises, naming the backend; their shapes (what
name checks need) are still given.

Reloading in place (`repack_after_reload`): vLLM's CPU build prepacks the experts when the
engine is built, but its in-place reload (`reload_weights`) re-runs the MoE method's weight
processing without the experts' prepack step (its `moe_kernel` exists by then), leaving the
loaded tensors in plain layout while the kernel reads them as packed: the engine would
compute with scrambled experts (measured on vLLM 0.32 CPU, tiny Qwen3-MoE: log-probs off the
HF model's by up to 0.37 after a reload; 9.5e-7 with the experts prepacked again). So
after every reload the layers it touched are prepacked in place, once it is seen on the
first load that vLLM left them plain (a vLLM that prepacks them itself is left alone).
A zero-padded intermediate size (CPU pads sizes its kernel cannot tile) is not handled there:
it raises, naming the layer.

Names that differ (`aliases`, set on the engine's model once at start by `_rpc_set_aliases`):
vLLM's Mixtral keeps its MoE layer as `block_sparse_moe` with checkpoint names w1/w3/w2, where
transformers 5 says `mlp` and `gate_up_proj`/`down_proj`. A trainer name that the engine lacks
is given the engine's name by `ALIASES` where that name exists with the same shape; the
worker-side functions (roles/vllm_weights.py) load under the engine's names and name what they
read back with the trainer's.

Tensor and expert parallelism split the experts' tensors; they are not mapped here
(`expert_weights` raises under either). Imports torch; vLLM only inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch

_RAW_BACKENDS = ("TRITON", "BATCHED_TRITON")  # keep w13/w2 as loaded
_perm_cache: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def is_routed_experts(mod: torch.nn.Module) -> bool:
    """A vLLM FusedMoE experts layer (its stacked w13/w2 parameters live on it)."""
    return hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight") and hasattr(mod, "layer_name")


def expert_names(mod: Any) -> tuple[str, str]:
    """The checkpoint names vLLM's expert loader takes stacked w13 and w2 tensors under."""
    gate, up, down = mod.ckpt_gate_proj_name, mod.ckpt_up_proj_name, mod.ckpt_down_proj_name
    gated = bool(getattr(mod.moe_config, "is_act_and_mul", True))
    if not gated:
        fused = gate
    elif (gate, up) == ("gate_proj", "up_proj"):
        fused = "gate_up_proj"
    elif (gate, up) == ("w1", "w3"):
        fused = "w13"
    else:
        raise NotImplementedError(f"{type(mod).__name__} {mod.layer_name}: expert projections named "
                                  f"{gate}/{up}/{down} have no stacked checkpoint name in vLLM")
    return f"{mod.layer_name}.{fused}", f"{mod.layer_name}.{down}"


def _parallel(mod: Any) -> str | None:
    cfg = mod.moe_config
    for what in ("tp_size", "ep_size", "dp_size"):
        if int(getattr(cfg, what, 1) or 1) > 1:
            return f"{what}={getattr(cfg, what)}"
    return None


def expert_weights(mod: Any, materialize: bool) -> list[tuple[str, torch.Tensor]]:
    """[(w13 name, (E, 2I, H)), (w2 name, (E, H, I))] as the engine computes with them (meta
    tensors of those shapes without `materialize`)."""
    cfg = mod.moe_config
    n_exp = int(cfg.num_logical_experts)
    inter = int(cfg.intermediate_size_per_partition)
    hidden = int(mod.w13_weight.shape[-1])
    rows = 2 * inter if bool(getattr(cfg, "is_act_and_mul", True)) else inter
    n13, n2 = expert_names(mod)
    if not materialize:
        meta = mod.w13_weight.dtype
        return [(n13, torch.empty((n_exp, rows, hidden), dtype=meta, device="meta")),
                (n2, torch.empty((n_exp, hidden, inter), dtype=meta, device="meta"))]
    if (par := _parallel(mod)) is not None:
        raise NotImplementedError(f"{mod.layer_name}: reading back experts split by {par} is not supported")
    w13, w2 = mod.w13_weight.detach(), mod.w2_weight.detach()
    backend = getattr(getattr(mod.quant_method, "unquantized_backend", None), "name", None)
    if backend == "CPU":
        experts = getattr(getattr(mod.quant_method, "moe_kernel", None), "fused_experts", None)
        if experts is not None and not getattr(experts, "_use_zentorch", False):
            isa = str(experts.isa)
            w13, w2 = _unpack(w13, isa), _unpack(w2, isa)
    elif backend not in _RAW_BACKENDS:
        raise NotImplementedError(f"{mod.layer_name}: vLLM's MoE backend {backend} keeps expert weights in a "
                                  "layout dynaresize does not read back")
    padded = int(w2.shape[-1])
    if padded != inter:  # CPU zero-pads the intermediate size of both halves and of w2
        w13 = torch.cat([w13[:, :inter], w13[:, padded:padded + inter]], dim=1) if rows == 2 * inter else w13[:, :inter]
        w2 = w2[:, :, :inter]
    return [(n13, w13[:n_exp].contiguous()), (n2, w2[:n_exp].contiguous())]


def _unpack(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """The tensor vLLM's CPU `prepack_moe_weight` turned into `packed` (an exact inverse)."""
    key = (tuple(packed.shape), isa)
    perm = _perm_cache.get(key)
    if perm is None:
        from vllm import _custom_ops as ops

        idx = torch.arange(packed.numel(), dtype=torch.int64)
        bits = 12 if packed.dtype == torch.float32 else 8  # integers below 2^bits are exact in the dtype
        digits = max(1, -(-max(1, int(packed.numel() - 1).bit_length()) // bits))
        perm = torch.zeros_like(idx)
        for d in range(digits):  # the index, `bits` at a time, each digit moved as the weights are
            probe = ((idx >> (bits * d)) & ((1 << bits) - 1)).to(packed.dtype).reshape(packed.shape)
            moved = ops.cpu_prepack_moe_weight(probe.contiguous(), isa).reshape(-1)
            perm += moved.to(torch.int64) << (bits * d)
        if not torch.equal(torch.sort(perm).values, idx):
            raise NotImplementedError(f"vLLM's CPU MoE prepack ({isa}) is not a permutation of elements: "
                                      "its expert weights cannot be read back")
        _perm_cache[key] = perm
    out = torch.empty(packed.numel(), dtype=packed.dtype)
    out[perm] = packed.reshape(-1)
    return out.reshape(packed.shape)


_repack: list[bool] = []  # [whether vLLM leaves reloaded CPU experts plain], once seen


def repack_known() -> bool:
    """Whether this process has seen which way vLLM leaves reloaded CPU experts."""
    return bool(_repack)


def _cpu_prepacking(mod: Any) -> Any:
    """The CPU experts kernel that prepacks `mod`'s weights, or None (another backend, zentorch)."""
    if getattr(getattr(mod.quant_method, "unquantized_backend", None), "name", None) != "CPU":
        return None
    experts = getattr(getattr(mod.quant_method, "moe_kernel", None), "fused_experts", None)
    return None if experts is None or getattr(experts, "_use_zentorch", False) else experts


def repack_after_reload(model: torch.nn.Module, touched: set[str], probe: dict[str, torch.Tensor]) -> int:
    """Prepack in place the CPU experts of every layer whose stacked names are in `touched`
    (the names a `reload_weights` call was given), where vLLM left them plain; `probe`: some
    of the tensors given ({name: tensor}), to see on the first load which way vLLM left them.
    Returns the number of tensors prepacked."""
    from vllm import _custom_ops as ops

    done = 0
    for mod in model.modules():
        if not is_routed_experts(mod) or (experts := _cpu_prepacking(mod)) is None:
            continue
        names = expert_names(mod)
        if not touched.intersection(names):
            continue
        if int(mod.w2_weight.shape[-1]) != int(mod.moe_config.intermediate_size_per_partition):
            raise NotImplementedError(f"{mod.layer_name}: vLLM's CPU build pads this MoE layer's intermediate size; "
                                      "reloading its experts in place is not supported")
        isa = str(experts.isa)
        if not _repack and (given := probe.get(names[0])) is not None:
            if torch.equal(mod.w13_weight.detach(), given.to(mod.w13_weight.dtype)):
                _repack.append(True)
            elif torch.equal(mod.w13_weight.detach(),
                             ops.cpu_prepack_moe_weight(given.to(mod.w13_weight.dtype).contiguous(), isa)):
                _repack.append(False)
            else:
                raise RuntimeError(f"{mod.layer_name}: after a reload vLLM's CPU experts hold neither the given "
                                   "weights nor their prepacked layout")
        if not _repack:
            raise RuntimeError(f"{mod.layer_name}: its stacked experts were not given whole on the first load")
        if _repack[0]:
            with torch.no_grad():
                for p in (mod.w13_weight, mod.w2_weight):
                    p.data.copy_(ops.cpu_prepack_moe_weight(p.data.contiguous(), isa))
                    done += 1
    return done


# (trainer substring, engine substring): transformers 5 names -> vLLM's, tried on a trainer name
# the engine lacks; kept only where the result is an engine weight of the same shape.
ALIASES = ((".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.w13"),
           (".mlp.experts.down_proj", ".block_sparse_moe.experts.w2"),
           (".mlp.gate.weight", ".block_sparse_moe.gate.weight"))
_ALIAS_ATTR = "_dynaresize_aliases"  # on the engine's model: {trainer name: engine name}


def aliases(engine: dict[str, tuple[int, ...]], trainer: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{trainer name: engine name} for the trainer's weights the engine holds under another name."""
    out: dict[str, str] = {}
    for name, shape in trainer.items():
        if name in engine:
            continue
        for ours, theirs in ALIASES:
            other = name.replace(ours, theirs)
            if other != name and other in engine and other not in trainer and tuple(engine[other]) == tuple(shape):
                out[name] = other
                break
    return out


def _rpc_set_aliases(worker: Any, alias: dict[str, str]) -> None:
    setattr(worker.model_runner.get_model(), _ALIAS_ATTR, dict(alias))


def to_engine(model: torch.nn.Module) -> dict[str, str]:
    """{trainer name: engine name} set on this engine's model ({} when the names are the same)."""
    return getattr(model, _ALIAS_ATTR, None) or {}
