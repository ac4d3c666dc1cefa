"""The vLLM engine's weights: how they are cut for in-place loading, digested, and read or
written inside vLLM's worker (the `_rpc_*` functions run there through `collective_rpc`).

- `weight_groups` / `weight_chunks`: a state dict cut so that a decoder layer (hence every fused
  group of it: q/k/v, gate/up, weight+bias) is never split across two reload calls;
- `checked_stream` / `check_complete`: a weight sync's stream of buckets (roles/weight_sync.py)
  fed to one reload call as it arrives, checked name by name;
- `state_dict_digest` and `_rpc_digest`: the same digest of the weights given and of the
  weights the engine computes with (`STALE_HEAD` marks a tied lm_head kernel that lags its
  embedding);
- `_engine_tensors` / `_linear_weight`: the engine's parameters as dense tensors (CPU kernels
  keep packed weights; a probe recovers them), whole under tensor parallelism (`_tp_full`:
  each rank's slice all-gathered, so every rank digests every rank's weights); an MoE layer's
  stacked experts under the trainer's stacked names (roles/vllm_moe.py), its router gate as a
  (replicated) linear layer.

Loading under tensor parallelism: every rank of a replica is sent the whole state dict and
vLLM's weight loaders keep its own slice, so a replica of k ranks receives k x the bytes of
one copy per load (the tiny test model: 2 x ~1.2 MB; a 7B fp32 one: k x 28 GB).

Used by `roles.rollout_vllm`; no engine state of its own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


# ---------------------------------------------------------------- digests and chunks


def state_dict_digest(state_dict: Mapping[str, Any], names: Iterable[str] | None = None,
                      dtype: torch.dtype = torch.float32) -> str:
    """`roles.weight_sync.weights_digest` of the named tensors of `state_dict` (all by default).

    The engine's `weights_digest` computes the same from the weights it actually computes
    with, so equal digests mean the engine holds exactly these weights."""
    from dynaresize.roles.weight_sync import weights_digest

    return weights_digest(((n, state_dict[n]) for n in (state_dict if names is None else names)), dtype)


def weight_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped so that every decoder layer (hence every fused group of it) is one group;
    weights outside the layers (embeddings, final norm, lm_head) form one more group."""
    layers: dict[str, list[str]] = {}
    rest: list[str] = []
    for name in names:
        m = _LAYER.search(name)
        if m:
            layers.setdefault(name[:m.end()], []).append(name)
        else:
            rest.append(name)
    groups = [layers[k] for k in sorted(layers, key=lambda k: (int(_LAYER.search(k).group(2)), k))]
    return groups + ([rest] if rest else [])


def weight_chunks(state_dict: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """`weight_groups` packed in order into chunks of at most `max_bytes` (a group larger than
    that is a chunk of its own; None or 0: one chunk)."""
    groups = weight_groups(state_dict)
    if not max_bytes:
        return [[n for g in groups for n in g]] if groups else []
    chunks: list[list[str]] = []
    size = 0
    for g in groups:
        g_bytes = sum(state_dict[n].numel() * state_dict[n].element_size() for n in g)
        if chunks and size + g_bytes <= max_bytes:
            chunks[-1].extend(g)
            size += g_bytes
        else:
            chunks.append(list(g))
            size = g_bytes
    return chunks


# ---------------------------------------------------------------- worker-side functions
# Run inside vLLM's worker through `collective_rpc` (first argument: the worker). Module-level
# so they would also pickle to a worker process.


def _rpc_reload(worker: Any, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`items` may be a stream (`checked_stream`): the engine runs in this process
    (roles/vllm_process.py), so the iterator is consumed here, not pickled."""
    from dynaresize.roles.vllm_moe import repack_after_reload, repack_known, to_engine

    undecided = not repack_known()
    touched: set[str] = set()
    probe: dict[str, torch.Tensor] = {}

    alias = to_engine(worker.model_runner.get_model())  # trainer -> engine names (roles/vllm_moe.py)

    def noted(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            name = alias.get(name, name)
            touched.add(name)
            if undecided and getattr(tensor, "dim", lambda: 0)() == 3:  # stacked experts, until vLLM's way is seen
                probe[name] = tensor
            yield name, tensor

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)  # "RotaryEmbedding: Failed to load weights": its cache is not a weight
    try:
        worker.model_runner.reload_weights(weights_iterator=noted(items))
    finally:
        layerwise.setLevel(level)
    repack_after_reload(worker.model_runner.get_model(), touched, probe)  # CPU experts: roles/vllm_moe.py


def _rpc_redispatch_tied_head(worker: Any) -> bool:
    """Rebuild the tied lm_head's kernel state from the (reloaded) embedding weights."""
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


def _rpc_weight_shapes(worker: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in _engine_tensors(worker.model_runner.get_model(), materialize=False)}


STALE_HEAD = "stale-tied-lm_head:"  # prefix of a digest whose tied lm_head kernel lags its embedding
REPLICAS_DIFFER = "tp-replicas-differ:"  # prefix of a digest where TP ranks hold different copies


def _rpc_digest(worker: Any, names: list[str] | None, dtype: torch.dtype) -> str:
    model = worker.model_runner.get_model()
    differ: list[str] = []
    tensors = dict(_engine_tensors(model, materialize=True, only=names, differ=differ))
    missing = sorted(set(names or ()) - set(tensors))
    if missing:
        raise KeyError(f"the engine holds no weight named {missing[:5]}")
    digest = state_dict_digest(tensors, names, dtype)
    if differ:  # the same on every rank: each saw every rank's copies
        digest = f"{REPLICAS_DIFFER}{','.join(differ[:3])}:{digest}"
    return STALE_HEAD + digest if _tp_any(_tied_head_is_stale(model)) else digest


def _tied_head_is_stale(model: torch.nn.Module) -> bool:
    """With tied embeddings the trainer names the shared weight once (the embedding), so the
    lm_head's own kernel state is checked here: read back, it must equal the embedding."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    vocab = int(embed.org_vocab_size)
    served = _linear_weight(head, True)[:vocab] + 0
    return not torch.equal(served.view(torch.uint8), (embed.weight.detach()[:vocab] + 0).contiguous().view(torch.uint8))


def _rpc_kv_cache_bytes(worker: Any) -> int:
    seen, total = set(), 0
    for t in getattr(worker.model_runner, "kv_caches", None) or []:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _engine_tensors(model: torch.nn.Module, *, materialize: bool, only: Sequence[str] | None = None,
                    differ: list[str] | None = None):
    """`_engine_weights` named as the trainer names them where the engine's names differ."""
    from dynaresize.roles.vllm_moe import to_engine

    alias = to_engine(model)
    back = {v: k for k, v in alias.items()}
    wanted = None if only is None else [alias.get(n, n) for n in only]
    for name, tensor in _engine_weights(model, materialize=materialize, only=wanted, differ=differ):
        yield back.get(name, name), tensor


def _engine_weights(model: torch.nn.Module, *, materialize: bool, only: Sequence[str] | None = None,
                    differ: list[str] | None = None):
    """(checkpoint name, tensor) for every weight the engine computes with, named as the
    trainer's (HF) state dict names them: fused q/k/v and gate/up split back, vocabulary
    padding cut off. On CPU, vLLM repacks linear weights into kernel handles and frees the
    originals; those are read back exactly by multiplying the kernel with the identity
    (fp32: each output is one weight times 1 plus exact zeros). With `materialize=False` the
    tensors are meta tensors of the right shape (no compute, no collective).

    Under tensor parallelism every tensor is the full (HF) one: with `materialize` each rank's
    slice is all-gathered over vLLM's TP group (a collective: every rank of the replica makes
    the same call), and so is each rank's copy of a replicated tensor (norms, row-parallel
    biases, repeated k/v heads): where copies differ the name is appended to `differ`, the
    first rank's copy is returned; without `materialize` only shapes are computed (`_tp_full`)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from dynaresize.roles.vllm_moe import expert_weights, is_routed_experts

    wanted = None if only is None else set(only)
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    world = _tp_world()
    for mod_name, mod in model.named_modules():
        params = dict(mod.named_parameters(recurse=False))
        if not params:
            continue
        if is_routed_experts(mod):  # stacked experts: roles/vllm_moe.py
            for name, tensor in expert_weights(mod, materialize):
                if wanted is None or name in wanted:
                    yield name, tensor
            continue
        prefix = f"{mod_name}." if mod_name else ""
        leaf = mod_name.rsplit(".", 1)[-1]
        parent = mod_name[:-len(leaf)]
        is_vocab = hasattr(mod, "org_vocab_size") and hasattr(mod, "embedding_dim")
        tp, dim = _tp_layout(mod)
        for pname in params:
            sizes: list[int] | None = None
            names = [f"{prefix}{pname}"]
            if leaf in packed and pname in ("weight", "bias") and hasattr(mod, "output_sizes"):
                names = [f"{parent}{sub}.{pname}" for sub in packed[leaf]]
                sizes = [int(s) for s in mod.output_sizes]
            if wanted is not None and not wanted.intersection(names):
                continue
            if pname == "weight" and isinstance(mod, (LinearBase, ParallelLMHead)):
                local = _linear_weight(mod, materialize)  # what the matmul uses (the embedding: its table)
            else:
                local = params[pname].detach() if materialize else params[pname].detach().to("meta")
            split = None if (dim == 1 and pname == "bias") else dim  # a row-parallel bias is whole on every rank
            along, copies = (0, world) if split is None else (split, 1)  # replicated: `world` copies
            if sizes is None:
                full = _tp_full(local, world, along, copies, materialize, differ, names[0])
                yield names[0], (full[:mod.org_vocab_size] if is_vocab and full.dim() == 2 else full)
            else:
                # Each rank holds every part's own slice (output_sizes // tp rows each); k/v
                # slices repeat on `num_kv_head_replicas` consecutive ranks when tp > kv heads.
                kv = int(getattr(mod, "num_kv_head_replicas", 1)) if len(sizes) == 3 and split == 0 else 1
                local_sizes = [s // tp for s in sizes] if split == 0 else sizes
                for i, (name, part) in enumerate(zip(names, torch.split(local, local_sizes, dim=0))):
                    yield name, _tp_full(part, world, along, copies * (kv if i else 1), materialize, differ, name)


def _tp_layout(mod: torch.nn.Module) -> tuple[int, int | None]:
    """(tensor-parallel size, the dimension its weights are split along: 0 column-parallel
    linear layers (q/k/v and gate/up included) and vocabulary tables, 1 row-parallel ones,
    None replicated) of a vLLM module."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp = int(getattr(mod, "tp_size", 1) or 1)
    if tp > 1 and isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return tp, 0
    if tp > 1 and isinstance(mod, RowParallelLinear):
        return tp, 1
    return 1, None


def _tp_world() -> int:
    """The size of vLLM's TP group in this process (1 where none is set up)."""
    from vllm.distributed import parallel_state as ps

    return int(ps.get_tp_group().world_size) if getattr(ps, "_TP", None) is not None else 1


def _tp_full(local: torch.Tensor, world: int, dim: int, copies: int, materialize: bool,
             differ: list[str] | None = None, name: str = "") -> torch.Tensor:
    """The whole tensor of which each of `world` ranks holds `local`: its slice along `dim`, in
    rank order, `copies` consecutive ranks holding the same slice (kept once; `copies` ==
    `world`: a replicated tensor). With `materialize` the slices are all-gathered over vLLM's
    TP group (a collective) and copies that differ append `name` to `differ`; else only the
    shape is computed (a meta tensor)."""
    if world == 1:
        return local
    if not materialize:
        shape = list(local.shape)
        shape[dim] *= world // copies
        return torch.empty(shape, dtype=local.dtype, device="meta")
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    slices = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(slices, local.contiguous(), group=get_tp_group().cpu_group)
    if differ is not None and any(not torch.equal(slices[i], slices[i - i % copies]) for i in range(world)):
        differ.append(name)
    return torch.cat(slices[::copies], dim=dim)


def _tp_any(flag: bool) -> bool:
    """`flag` of any rank of vLLM's TP group (a collective when TP > 1)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return bool(t.item())


def _linear_weight(mod: torch.nn.Module, materialize: bool, rows_per_probe: int = 1024) -> torch.Tensor:
    """The (out, in) weight a linear (or lm_head) module computes with."""
    w = mod.weight
    if hasattr(mod, "embedding_dim"):  # ParallelLMHead / VocabParallelEmbedding
        n_out, n_in = int(mod.num_embeddings_per_partition), int(mod.embedding_dim)
    else:  # a replicated linear (an MoE router's gate) has no per-partition sizes: it is whole
        n_out = int(getattr(mod, "output_size_per_partition", None) or mod.output_size)
        n_in = int(getattr(mod, "input_size_per_partition", None) or mod.input_size)
    if not materialize:
        return torch.empty((n_out, n_in), dtype=w.dtype, device="meta")
    kernel = getattr(mod, "cpu_linear", None)
    if kernel is None:
        return w.detach()
    with torch.no_grad():
        cols = []
        for lo in range(0, n_in, rows_per_probe):
            hi = min(n_in, lo + rows_per_probe)
            eye = torch.zeros((hi - lo, n_in), dtype=w.dtype)
            eye[torch.arange(hi - lo), torch.arange(lo, hi)] = 1
            cols.append(kernel(eye, w, None))  # (hi-lo, n_out) = W[:, lo:hi]^T
        return torch.cat(cols, dim=0).t().contiguous()


def check_names(state_dict: Mapping[str, Any], shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Every engine weight given once with its shape (a tied lm_head may be left out)."""
    names = set(state_dict)
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(shapes) - optional - names)
    unexpected = sorted(names - set(shapes))
    if missing or unexpected:
        raise RuntimeError(f"vLLM engine weights: missing key(s) {missing[:8]}, unexpected key(s) "
                           f"{unexpected[:8]} (of {len(names)} given, {len(shapes)} expected)")
    for name in sorted(names):
        shape = tuple(state_dict[name].shape)
        if shape != shapes[name]:
            raise RuntimeError(f"vLLM engine weights: {name} has shape {shape}, the engine {shapes[name]}")


def checked_stream(chunks: Iterable[list[tuple[str, Any]]], shapes: dict[str, tuple[int, ...]],
                   seen: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, weight) pairs of a stream of chunks, each checked against the engine's
    weights as it passes (an unknown name, a repeat or a wrong shape raises inside vLLM's
    load, before anything of it is copied); `seen` collects the names. A chunk is emptied
    once its pairs went by, so its buffer can go as soon as vLLM lets go of them."""
    for chunk in chunks:
        for name, tensor in chunk:
            if name not in shapes or name in seen or tuple(tensor.shape) != shapes[name]:
                why = ("unexpected" if name not in shapes else "given twice" if name in seen
                       else f"has shape {tuple(tensor.shape)}, the engine {shapes[name]}")
                raise RuntimeError(f"vLLM engine weights: {name} {why}")
            seen.add(name)
            yield name, tensor
        chunk.clear()


def check_complete(seen: set[str], shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
    """After a streamed load: every engine weight was given (a tied lm_head may be left out)."""
    missing = sorted(set(shapes) - ({"lm_head.weight"} if tied else set()) - seen)
    if missing:
        raise RuntimeError(f"vLLM engine weights: missing key(s) {missing[:8]} (of {len(seen)} given, "
                           f"{len(shapes)} expected)")


def load_into(llm: Any, weights: Mapping[str, Any] | Iterable[list[tuple[str, Any]]], *,
              shapes: dict[str, tuple[int, ...]], tied: bool, chunk_bytes: int) -> None:
    """Load every weight of the engine `llm` in place, then re-dispatch a tied lm_head and reset
    the prefix cache. A state dict: checked whole, then loaded in chunks of whole layers
    (`chunk_bytes`). A stream of chunks (roles/weight_sync.py): one `reload_weights` call over
    an iterator that asks for the next chunk only once vLLM took the last one's weights (vLLM
    loads each module as its weights complete, and a chunk never splits one), so at most two
    chunks are held outside the engine; names and shapes are checked as they arrive,
    completeness at the end."""
    if isinstance(weights, Mapping):
        check_names(weights, shapes, tied)
        sd = {k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in weights.items()}
        for chunk in weight_chunks(sd, chunk_bytes):
            llm.collective_rpc(_rpc_reload, args=([(n, sd[n]) for n in chunk],))
    else:
        seen: set[str] = set()
        llm.collective_rpc(_rpc_reload, args=(checked_stream(weights, shapes, seen),))
        check_complete(seen, shapes, tied)
    if tied:
        llm.collective_rpc(_rpc_redispatch_tied_head)
    reset_prefix_cache(llm)


def reset_prefix_cache(llm: Any) -> None:
    """Drop every cached prefix block: its KV was computed with the old weights. vLLM refuses
    (returns False) while running requests hold blocks, as under partial rollout (requests go on
    across a weight update); then the running requests are reset too (vLLM preempts them and
    computes their KV again, under the new weights, when they are scheduled next: the tokens
    they made stay theirs). Raises if vLLM still refuses: new requests would reuse stale KV."""
    if llm.reset_prefix_cache():
        return
    if not llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight update, even with its running "
                           "requests reset: cached KV of the old weights would be reused")
