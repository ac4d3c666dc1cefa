"""A tensor-parallel vLLM rollout replica: one `VLLMRolloutEngine` per device worker, each one
TP rank (`roles.base.TPPlacement`), built with vLLM's `external_launcher` executor.

How it works: every rank runs a whole engine of its own (scheduler, sampler, KV cache of its
heads) in its worker's process; the ranks meet only in the model's collectives, over vLLM's
TP group. So the ranks stay in step only if each is made the same calls in the same order
(start, add, step, abort, load_weights, weights_digest, release): the caller guarantees it,
and then every rank returns the same results. Sampling is per-request seeded, so a TP replica
samples the tokens a one-rank engine of the same weights samples (log-probs differ by the
all-reduce's summation order; tests/dist/test_rollout_vllm_tp.py measures both).

What this module adds for the engine's creation (`tp_creation`):
- vLLM's env:// rendezvous: RANK, LOCAL_RANK (the TP rank on the CPU; 0 on CUDA, where an
  actor sees only its own GPU), WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set while vLLM
  builds its world, then removed (or restored);
- vLLM's CPU shared-memory all-reduce is switched off for the engine's groups, so they use
  torch.distributed (gloo). Why: that communicator names its shared-memory segment after
  VLLM_DIST_IDENT, which under env:// is the same for every replica on a node (two replicas
  of one node would attach to one segment), and it waits on a dead peer forever (gloo has
  a timeout);
- the group names: `roles.vllm_world.tp_name_base(master_port)`, the same on every rank.
`fixed_request_ids` keeps vLLM from appending random characters to request ids, so the ranks'
schedulers see identical requests.

Weights: every rank is sent the whole state dict (vLLM's weight loaders keep its slice), and
`weights_digest` all-gathers the slices (roles/vllm_weights.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dynaresize.roles.base import TPPlacement

LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
REQUEST_ID_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"


def check_placement(tp: TPPlacement | None) -> TPPlacement | None:
    """`tp` if it names a valid rank (ValueError otherwise); None for one rank."""
    if tp is None:
        return None
    if tp.size < 1 or not 0 <= tp.rank < tp.size:
        raise ValueError(f"tensor-parallel placement {tp}: need size >= 1 and 0 <= rank < size")
    if tp.size > 1 and not (tp.master_addr and 0 < tp.master_port < 65536):
        raise ValueError(f"tensor-parallel placement {tp}: needs a master address and port")
    return tp if tp.size > 1 else None


def tp_engine_kwargs(tp: TPPlacement | None, *, cuda: bool | None = None) -> dict[str, Any]:
    """The `vllm.LLM` arguments of a TP rank (none for one rank). On CUDA vLLM's custom
    all-reduce is off: it opens its peers' buffers by TP rank over CUDA IPC, and each of our
    ranks is an actor that sees only its own GPU (cuda:0), so its peers are not visible to it;
    the ranks all-reduce through NCCL instead."""
    if tp is None:
        return {}
    kwargs: dict[str, Any] = {"tensor_parallel_size": tp.size, "distributed_executor_backend": "external_launcher"}
    if _cuda() if cuda is None else cuda:
        kwargs["disable_custom_all_reduce"] = True
    return kwargs


@contextmanager
def tp_creation(tp: TPPlacement | None) -> Iterator[None]:
    """Wrap the engine's creation of a TP rank (see the module docstring); nothing for one rank."""
    if tp is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    # LOCAL_RANK picks the device: each actor sees only its own GPU (cuda:0), so on CUDA it is 0
    # for every rank; on the CPU vLLM binds threads by it, so there it is the TP rank.
    local = 0 if _cuda() else tp.rank
    os.environ.update(RANK=str(tp.rank), LOCAL_RANK=str(local), WORLD_SIZE=str(tp.size),
                      MASTER_ADDR=str(tp.master_addr), MASTER_PORT=str(tp.master_port))
    try:
        with _torch_distributed_communicators():
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@contextmanager
def _torch_distributed_communicators() -> Iterator[None]:
    """vLLM's CPU communicators built inside the block use torch.distributed, never the
    shared-memory all-reduce (why: the module docstring). Its choice asks whether all ranks
    share one segment name; answering False picks the torch.distributed path. Every rank of
    the replica answers the same without asking the others (the real check is a collective),
    so none waits for a peer. Restored afterwards: one-rank engines keep vLLM's default."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:  # a build without the CPU communicator (CUDA): nothing to switch
        yield
        return
    cls = cpu_communicator.CpuCommunicator
    original = cls.__dict__.get("_all_group_ranks_share_shm_group_name")
    cls._all_group_ranks_share_shm_group_name = lambda self: False
    try:
        yield
    finally:
        if original is None:
            del cls._all_group_ranks_share_shm_group_name
        else:
            cls._all_group_ranks_share_shm_group_name = original


def fixed_request_ids(on: bool) -> None:
    """Switch vLLM's request-id randomization off (`on`) or back to its default. vLLM caches
    its environment once an engine started, so the cache is cleared for the new value."""
    if on:
        os.environ[REQUEST_ID_ENV] = "1"
    else:
        os.environ.pop(REQUEST_ID_ENV, None)
    from vllm import envs

    clear = getattr(getattr(envs, "__getattr__", None), "cache_clear", None)
    if clear is not None:
        clear()


def _rpc_tp_info(worker: Any) -> dict:
    """The engine's TP group as vLLM built it (for checks): rank, size, and which all-reduce
    its communicator uses (`dist_module`: the torch.distributed module, not the SHM one)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    module = getattr(group.device_communicator, "dist_module", None)
    return {"rank": int(group.rank_in_group), "size": int(group.world_size),
            "dist_module": getattr(module, "__name__", type(module).__name__)}
