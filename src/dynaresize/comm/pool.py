"""A per-worker pool of communicators (process groups), cached by rank set.

A resize must not create a new world, and at steady state (a split seen before) it must not
create a new group either: `CommPool.create` makes the group of a rank set once and every
later `create` of the same set is a cache hit. The driver pre-warms, off the critical path,
the groups of the splits the policy may pick next (`rank_sets_for_split`).

THE POOL'S INVARIANT (callers must keep it): `create` is collective over the whole world.
Every worker of the world calls `create` for the same rank sets, with the same tags, in the
same order, including workers that are not members of the set. torch names a group from a
per-process counter that every `new_group` call advances; if one rank skips or reorders a call,
names drift and a later group times out (measured;
`use_local_synchronization=True` was unreliable). The driver keeps it by broadcasting one
ordered list of rank sets to every worker. Because every rank sees the same sequence, the cache
holds the same keys on every rank, so a cache hit is skipped consistently everywhere.
The pool's lock guards its maps and counts only and is never held across `new_group` (which
blocks until every rank calls it): a thread reading the pool is never held behind a peer. The
order of creations across ranks is the driver's business: it issues them from one place. A
device worker names its issuing thread (`issuer`, cluster/worker.py: every collective of a
device comes from one thread) and the pool refuses creation from any other; without an issuer,
a second thread creating the same set while the first is still in `new_group` is refused.

Failure semantics (NCCL's; docs/faults.md): a creation first checks every rank of the world in
under a store key (`rendezvous.checkin`, keyed by the pool's creation count, the same on every
rank by the invariant above), so a dead rank ends it with `GroupCreationFailed` within the
pool's timeout, or at once when the world is aborted, instead of hanging every survivor in
NCCL's split (which has no timeout); a creation in an aborted world is refused at once.

Other invariants:
- Bounded: `retain(keep)` destroys every group outside `keep` (the driver passes the groups of
  the current split, of the splits it pre-warms and the background group), so the number held
  does not grow with the number of moves; `stats()["num_groups_max"]` is the most held at once.
- Every group gets an explicit timeout: the pool's (`timeouts.collective_s`), or for a small
  group (at most `SMALL_GROUP_RANKS` ranks) the shorter `SMALL_GROUP_S` when that is below it:
  its collectives are few-peer and short, so a peer lost mid-collective frees its partners
  sooner when no abort reaches them (the check-in before creation keeps the pool's timeout:
  ranks arrive there as their earlier work ends).
- Keys are `(tag, sorted ranks)`. A tag gives a second, independent group over the same
  ranks, e.g. a "background" group on which optimizer state moves in a thread while the main
  thread runs collectives on the training group (two threads must never share one group).
- Counts in `stats()` are identical on every rank (non-members count the call too).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Iterable

import torch.distributed as dist

from dynaresize.comm import rendezvous

RankSet = tuple[int, ...]
SMALL_GROUP_RANKS = 8  # groups of at most this many ranks get the short timeout
SMALL_GROUP_S = 120.0  # the short timeout (seconds), when below the pool's


def group_timeout_s(num_ranks: int, timeout_s: float) -> float:
    """The explicit timeout of a group of `num_ranks` ranks in a pool with timeout `timeout_s`."""
    return min(timeout_s, SMALL_GROUP_S) if num_ranks <= SMALL_GROUP_RANKS else timeout_s


def _key(ranks: Iterable[int], tag: str) -> tuple[str, RankSet]:
    rs = tuple(sorted(int(r) for r in ranks))
    if not rs:
        raise ValueError("ranks: a group needs at least one rank, got ()")
    if len(set(rs)) != len(rs):
        raise ValueError(f"ranks: duplicates in {rs}")
    return tag, rs


class CommPool:
    """Groups of the live world, created once per (tag, rank set) and cached."""

    def __init__(self, *, timeout_s: float, backend: str | None = None, issuer: int | None = None) -> None:
        """`issuer`: the `threading.get_ident()` of the only thread allowed to create groups."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        self._timeout_s = float(timeout_s)
        self._num_creations = 0  # creations that reached the world (same on every rank): check-in keys
        self._backend = backend  # None: the world's backend
        self._issuer = issuer
        self._groups: dict[tuple[str, RankSet], object | None] = {}
        self._creating: set[tuple[str, RankSet]] = set()  # keys whose `new_group` is in flight
        self._lock = threading.Lock()  # guards the maps and counts only, never held across a call that blocks
        self._num_created_critical = 0
        self._num_created_background = 0
        self._num_cache_hits = 0
        self._num_destroyed = 0
        self._num_groups_max = 0
        self._create_s_total = 0.0
        self._create_s_max = 0.0

    def create(self, ranks: Iterable[int], *, critical: bool, tag: str = "") -> bool:
        """Create the group of `ranks` unless cached; True when a group was created now.

        Collective over the whole world (see the module invariant). `critical` says whether a
        device's first useful work waits for this call; it only affects the counts.
        """
        key = _key(ranks, tag)
        if self._issuer is not None and threading.get_ident() != self._issuer:
            raise RuntimeError(f"CommPool.create: ranks {key[1]} (tag {tag!r}) from thread "
                               f"{threading.current_thread().name!r}, not the device's issuing thread: every "
                               "collective of a device is issued by one thread (cluster/worker.py)")
        with self._lock:
            if key in self._groups:
                self._num_cache_hits += 1
                return False
            if key in self._creating:
                raise RuntimeError(f"CommPool.create: ranks {key[1]} (tag {tag!r}) are being created by another "
                                   "thread; the driver issues group creation from one place (module docstring)")
            if rendezvous.aborted():
                raise rendezvous.GroupCreationFailed(f"CommPool.create: ranks {key[1]} (tag {tag!r}): the world "
                                                     "was aborted (a peer was lost); no communicator was created")
            if not dist.is_initialized():
                raise RuntimeError("CommPool.create: no live world; call init_world first")
            world_size = dist.get_world_size()
            if key[1][-1] >= world_size:
                raise ValueError(f"ranks: {key[1]} outside the world of size {world_size}")
            self._creating.add(key)
            seq = self._num_creations
            self._num_creations += 1
        # `new_group` blocks until every rank of the world calls it: never under the lock, so a
        # thread that only reads the pool (`get`, `has`, `stats`) is never held behind a peer.
        try:
            start = time.perf_counter()
            world = rendezvous.live_world()
            rendezvous.checkin(f"g{world.generation if world else 0}/create{seq}", rank=dist.get_rank(),
                               world_size=world_size, timeout_s=self._timeout_s)
            group = dist.new_group(
                list(key[1]),
                timeout=timedelta(seconds=group_timeout_s(len(key[1]), self._timeout_s)),
                backend=self._backend,
                group_desc=f"dynaresize:{tag or 'default'}:{','.join(map(str, key[1]))}",
            )
            elapsed = time.perf_counter() - start
            member = dist.get_rank() in key[1]
        finally:
            with self._lock:
                self._creating.discard(key)
        with self._lock:
            # Non-members get a sentinel, not a group: store None so `get` answers plainly.
            self._groups[key] = group if member else None
            self._num_groups_max = max(self._num_groups_max, len(self._groups))
            self._create_s_total += elapsed
            self._create_s_max = max(self._create_s_max, elapsed)
            if critical:
                self._num_created_critical += 1
            else:
                self._num_created_background += 1
        return True

    def create_many(self, rank_sets: Iterable[Iterable[int]], *, critical: bool, tag: str = "") -> int:
        """`create` each rank set in order; the number of groups created now."""
        return sum(self.create(rs, critical=critical, tag=tag) for rs in rank_sets)

    def get(self, ranks: Iterable[int], *, tag: str = ""):
        """The cached group of `ranks`, or None when this worker is not a member.

        KeyError when the set was never created: creating lazily here would break the pool's
        invariant (only the members would call `new_group`).
        """
        key = _key(ranks, tag)
        with self._lock:
            if key not in self._groups:
                raise KeyError(f"no group for ranks {key[1]} (tag {tag!r}); the driver must create it first")
            return self._groups[key]

    def has(self, ranks: Iterable[int], *, tag: str = "") -> bool:
        """Whether the group of `ranks` was created (whether or not this worker is a member)."""
        with self._lock:
            return _key(ranks, tag) in self._groups

    def retain(self, keep: Iterable[tuple[str, Iterable[int]]]) -> list[tuple[str, RankSet]]:
        """Destroy every cached group whose (tag, ranks) is not in `keep`; the keys destroyed,
        in a fixed order. Like `create`, called by every worker with the same `keep` at the
        same point of the driver's order (cluster/cluster.py `_prewarm`), so the cache holds
        the same keys everywhere; destroying is local (no collective), and a set destroyed
        here is created again by a later `create` of it. A communicator holds device memory
        (NCCL: buffers per peer) for as long as it lives, so a device keeps only those of the
        split it runs and of the splits it may move to next: bounded, however many moves."""
        if self._issuer is not None and threading.get_ident() != self._issuer:
            raise RuntimeError(f"CommPool.retain from thread {threading.current_thread().name!r}, not the device's "
                               "issuing thread (cluster/worker.py)")
        wanted = {_key(ranks, tag) for tag, ranks in keep}
        with self._lock:
            gone = sorted(k for k in self._groups if k not in wanted)
            groups = [self._groups.pop(k) for k in gone]
            self._num_destroyed += len(gone)
        for group in groups:  # never under the lock (as `create`)
            if group is not None:
                dist.destroy_process_group(group)
        return gone

    def clear(self) -> None:
        """Forget every group (after `rendezvous.destroy_world()`, which destroyed them).

        Counts are kept: they describe the whole life of the worker.
        """
        with self._lock:
            self._groups.clear()

    def stats(self) -> dict:
        """Counts for records; identical on every rank of the world."""
        with self._lock:
            return {
                "groups_created": self._num_created_critical + self._num_created_background,
                "groups_created_critical": self._num_created_critical,
                "groups_created_background": self._num_created_background,
                "cache_hits": self._num_cache_hits,
                "world_inits": rendezvous.world_inits(),
                "num_groups": len(self._groups),
                "num_groups_max": self._num_groups_max,
                "groups_destroyed": self._num_destroyed,
                "create_s_total": self._create_s_total,
                "create_s_max": self._create_s_max,
            }


def rank_sets_for_split(
    train_ranks: Iterable[int],
    rollout_ranks: Iterable[int],
    *,
    sync_root: int | None = None,
) -> tuple[RankSet, ...]:
    """The rank sets a split needs, in a fixed order: the training group, then the weight-sync
    group (`sync_root` (default: the lowest train rank) plus every rollout rank).

    The weight-sync group is left out when there are no rollout ranks. Feed the result of
    every split the policy may pick next to `CommPool.create_many(..., critical=False)` on
    every worker, in the same order, to pre-warm them.
    """
    train = tuple(sorted(set(int(r) for r in train_ranks)))
    rollout = tuple(sorted(set(int(r) for r in rollout_ranks)))
    if not train:
        raise ValueError("train_ranks: a split needs at least one train rank")
    if set(train) & set(rollout):
        raise ValueError(f"rollout_ranks: {rollout} overlaps train_ranks {train}")
    root = train[0] if sync_root is None else int(sync_root)
    if root not in train:
        raise ValueError(f"sync_root: {root} is not a train rank of {train}")
    if not rollout:
        return (train,)
    return (train, tuple(sorted((root, *rollout))))
