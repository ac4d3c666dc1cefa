"""Joining the one torch.distributed world of a run, once per generation.

Every device worker joins one world (gloo on CPU, NCCL on CUDA) when it starts, and keeps
it: a resize never creates a new world (groups for rank sets come from `comm.pool.CommPool`).
`world_inits()` counts the worlds this process initialised, so the runtime can prove it.

Generations: after a worker is lost, the survivors may form a new world generation on a
fresh port (a fresh TCP store, hence a fresh key space): every survivor calls
`destroy_world()`, drops its pool (`CommPool.clear()`), then `init_world(...,
generation=g + 1)` with the new rank numbering. Destroying the world also resets torch's
group-name counter, so groups created in the new generation get matching names on every rank.

Failure semantics (NCCL's, kept on gloo too; docs/faults.md):
- `abort_world()` aborts every communicator of the live world and may be called from any
  thread: it is what a survivor's `ctl` thread runs on the first loss, while its issuing thread
  may be blocked with the lost peer (NCCL's abort is the call meant for another thread; it frees
  that thread at once. gloo's does not interrupt a running collective: there the group's timeout
  frees it). After it, every later collective and group creation of this world fails at once.
- `destroy_world()` aborts before it destroys: NCCL's `destroy_process_group` may wait on
  work a dead peer never finishes; an aborted communicator has nothing left to wait for.
- `checkin(...)`: group creation is collective over the world, and NCCL's split has no timeout,
  so a dead rank would hang every survivor inside it. Before every creation each rank checks in
  under a key of the world's store (keyed by the creation's sequence number) and waits, in
  short slices, for every rank's key: a dead rank never arrives, and the wait ends, bounded by
  the timeout, or at once when the world is aborted, with `GroupCreationFailed` naming the
  missing ranks. Only then is the communicator created, by ranks that are all alive.

Invariants:
- At most one world is live per process; `init_world` with the generation already live (same
  rank and size) is a no-op, anything else while a world is live is refused.
- Every world gets an explicit timeout (gloo's default is 30 minutes; a survivor of a lost
  rank would hang that long).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

_lock = threading.Lock()
_abort_lock = threading.Lock()  # not `_lock`: an abort must never wait behind an `init_world` in flight
_num_world_inits = 0
_aborted = False  # the live world was aborted (`abort_world`); cleared when it is destroyed
CHECKIN_SLICE_S = 0.5  # a check-in looks at the abort flag at least this often


class GroupCreationFailed(RuntimeError):
    """A group creation ended before every rank of the world arrived (a dead rank, an abort)."""


@dataclass(frozen=True)
class WorldInfo:
    """The live world of this process."""

    rank: int
    world_size: int
    backend: str
    generation: int
    init_method: str
    timeout_s: float


_live: WorldInfo | None = None


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (the OS picks it).

    There is a small window in which another process may take it; callers that lose the race
    get a clear bind error from the store and retry with a new port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This node's IP address as other nodes of the Ray cluster see it (127.0.0.1 alone)."""
    try:
        import ray  # only present in the real shell; the import is cheap when already loaded

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        # A UDP "connect" sends nothing; it only asks the kernel which interface would route.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def world_init_method(ip: str, port: int) -> str:
    """The `init_method` URL of a world whose TCP store rank 0 hosts at `ip:port`."""
    if not ip or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port: expected 1..65535 and a non-empty ip, got ip={ip!r} port={port!r}")
    host = f"[{ip}]" if ":" in ip else ip  # IPv6 literals need brackets in a URL
    return f"tcp://{host}:{port}"


def default_backend() -> str:
    """NCCL where CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_world(
    *,
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "auto",
    timeout_s: float,
    generation: int = 0,
    device_index: int | None = None,
) -> WorldInfo:
    """Join the world of generation `generation` as `rank` of `world_size`. Collective.

    `backend` is "gloo", "nccl" or "auto" (NCCL when CUDA is available). With NCCL the world is
    bound to `cuda:{device_index}` (default: the current device; inside a Ray actor with one
    GPU that is cuda:0), which makes NCCL create communicators eagerly and lets groups inherit
    the device.
    """
    global _live, _num_world_inits
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is outside 0..{world_size - 1}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
    name = default_backend() if backend == "auto" else backend
    if name not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected gloo, nccl or auto, got {backend!r}")
    with _lock:
        if _live is not None:
            if (_live.generation, _live.rank, _live.world_size) == (generation, rank, world_size):
                return _live
            raise RuntimeError(
                f"world generation {_live.generation} (rank {_live.rank} of {_live.world_size}) is "
                f"live; call destroy_world() before joining generation {generation}"
            )
        kwargs: dict = {}
        if name == "nccl":
            index = torch.cuda.current_device() if device_index is None else device_index
            torch.cuda.set_device(index)
            kwargs["device_id"] = torch.device("cuda", index)
        dist.init_process_group(
            backend=name,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        _num_world_inits += 1
        _live = WorldInfo(
            rank=rank,
            world_size=world_size,
            backend=name,
            generation=generation,
            init_method=init_method,
            timeout_s=float(timeout_s),
        )
        return _live


def abort_world() -> bool:
    """Abort every communicator of the live world, default group included; any thread. True
    when one was live. Idempotent (module docstring: failure semantics)."""
    global _aborted
    from torch.distributed.distributed_c10d import _abort_process_group

    with _abort_lock:
        if not dist.is_initialized():
            return False
        _aborted = True
        _abort_process_group(None)  # every group, within one NCCL group call (no abort waits on another)
        return True


def aborted() -> bool:
    """Whether the live world was aborted (its collectives and group creations fail at once)."""
    return _aborted


def destroy_world() -> None:
    """Leave the live world and every group in it (no-op when none is live). Not collective.

    Aborts first (`abort_world`), then destroys what is left: a group registered by a creation
    that raced the abort is aborted too, and torch's group-name counter starts from 0 again."""
    global _live, _aborted
    with _lock:
        abort_world()
        _forget_leftovers()
        if dist.is_initialized():  # (an abort leaves none; kept for a backend without abort)
            dist.destroy_process_group()
        _live, _aborted = None, False


def _forget_leftovers() -> None:
    """Groups a `new_group` still registered after the world's abort (it raced it on the
    issuing thread): abort them and clear torch's registry, so the next generation's group
    names start from the same counter on every rank."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    if dist.is_initialized() or not world.pg_map:
        return
    for pg in list(world.pg_map):
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - already aborted or destroyed
            pass
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    world.group_count = 0


def _store() -> Any:
    """The live world's store (its TCP store under the default group's prefix)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def checkin(name: str, *, rank: int, world_size: int, timeout_s: float, store: Any = None,
            clock: Callable[[], float] | None = None) -> float:
    """Every rank of the world calls this with the same `name` before a group creation; returns
    once all `world_size` ranks have, the seconds it waited. `GroupCreationFailed` naming the
    ranks that never came, once `timeout_s` passed or the world was aborted (module docstring)."""
    store = _store() if store is None else store
    clock = clock or time.monotonic
    keys = [f"dynaresize/checkin/{name}/{r}" for r in range(world_size)]
    store.set(keys[rank], b"1")
    start = clock()
    if store.check(keys):  # the usual case, every rank there: no timed wait (a TCP store logs each that ends)
        return 0.0
    while True:
        if _aborted:
            raise GroupCreationFailed(f"group creation {name}: the world was aborted (a peer was lost)")
        left = timeout_s - (clock() - start)
        try:
            store.wait(keys, timedelta(seconds=max(0.001, min(CHECKIN_SLICE_S, left))))
            return clock() - start
        except RuntimeError:  # DistStoreError: the slice ended before every key was there
            pass
        if clock() - start >= timeout_s:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise GroupCreationFailed(f"group creation {name}: world ranks {missing} did not arrive within "
                                      f"{timeout_s:g}s (lost?); no communicator was created")


def world_inits() -> int:
    """How many worlds this process has initialised (1 for a run without faults)."""
    return _num_world_inits


def world_info() -> dict | None:
    """The live world as a plain dict (for records), or None."""
    return None if _live is None else asdict(_live)


def live_world() -> WorldInfo | None:
    return _live
