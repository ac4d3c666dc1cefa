"""A small test-only Ray actor over the comm and reshard modules (not the product worker).

`start_world(n)` reserves n CPU bundles with `cluster.placement`, starts one `CommActor` per
bundle, and has them join one gloo world. Each actor keeps flat shards of a deterministic
random state (fp32 kinds with random bit patterns, NaNs included, and an int64 kind), so the
driver can check any reshard bit for bit against slices of the same full state.
"""

from __future__ import annotations

import sys
import threading

import ray
import torch
import torch.distributed as dist

from dynaresize.cluster.placement import actor_options, make_placement_group
from dynaresize.comm import rendezvous
from dynaresize.comm.pool import CommPool
from dynaresize.reshard.execute import reshard_flat
from dynaresize.reshard.layout import FlatLayout

KINDS = {"param": torch.float32, "exp_avg": torch.float32, "count": torch.int64}
TIMEOUT_S = 60.0


def full_state(numel: int, seed: int) -> dict[str, torch.Tensor]:
    """The whole flat state: random bytes, so every bit pattern (NaN payloads too) must survive."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(KINDS):
        dtype = KINDS[name]
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class CommActor:
    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)  # measured: two threads made collectives slower
        self.rank = rank
        self.world_size = world_size
        self.pool: CommPool | None = None
        self.shards: dict[str, torch.Tensor] = {}
        self.kind_ranks: dict[str, tuple[int, ...]] = {}
        self.numel = 0
        self._bg: threading.Thread | None = None
        self._bg_result: object = None

    def address(self) -> str:
        return rendezvous.world_init_method(rendezvous.node_ip(), rendezvous.free_port())

    def init(self, init_method: str, generation: int = 0) -> float:
        import time

        t0 = time.perf_counter()
        rendezvous.init_world(
            rank=self.rank,
            world_size=self.world_size,
            init_method=init_method,
            backend="gloo",
            timeout_s=TIMEOUT_S,
            generation=generation,
        )
        if self.pool is None:
            self.pool = CommPool(timeout_s=TIMEOUT_S)
        return time.perf_counter() - t0

    def leave(self) -> None:
        """Leave the world and drop the pool's groups (what every survivor does after a loss)."""
        rendezvous.destroy_world()
        self.pool.clear()

    def rejoin(self, init_method: str, rank: int, world_size: int, generation: int) -> dict:
        """Join a new world generation with a new rank numbering (issue 5's recovery)."""
        self.rank, self.world_size = rank, world_size
        self.init(init_method, generation)
        return rendezvous.world_info()

    def create(self, rank_sets: list[tuple[int, ...]], critical: bool, tag: str = "") -> int:
        return self.pool.create_many(rank_sets, critical=critical, tag=tag)

    def stats(self) -> dict:
        return self.pool.stats()

    def retain(self, keep: list) -> list:
        return [list(k) for k in self.pool.retain(keep)]

    def group_view(self, ranks: tuple[int, ...], tag: str = "") -> dict:
        group = self.pool.get(ranks, tag=tag)
        if group is None:
            return {"member": False}
        return {"member": True, "size": dist.get_world_size(group), "group_rank": dist.get_rank(group)}

    def all_reduce(self, ranks: tuple[int, ...], value: float, repeats: int = 1, tag: str = "") -> float | None:
        group = self.pool.get(ranks, tag=tag)
        if group is None:
            return None
        out = None
        for _ in range(repeats):
            t = torch.full((1024,), float(value))
            dist.all_reduce(t, group=group)
            out = float(t[0])
        return out

    def load(self, numel: int, ranks: tuple[int, ...], seed: int) -> None:
        full = full_state(numel, seed)
        lo, hi = FlatLayout(numel, ranks).shard_range(self.rank) if self.rank in ranks else (0, 0)
        self.numel = numel
        self.shards = {k: v[lo:hi].clone() for k, v in full.items()}
        self.kind_ranks = {k: tuple(sorted(ranks)) for k in full}

    def get_shards(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.shards.items()}

    def reshard(
        self,
        new_ranks: tuple[int, ...],
        staging_bytes: int,
        kinds: list[str] | None = None,
        tag: str | None = None,
    ) -> dict:
        """Move `kinds` (default all) to `new_ranks`; `tag` None: world group, else pool group."""
        names = sorted(kinds or self.shards)
        old_ranks = self.kind_ranks[names[0]]
        assert all(self.kind_ranks[k] == old_ranks for k in names)
        group = None if tag is None else self.pool.get(tuple(range(self.world_size)), tag=tag)
        # Every rank computes the plan itself (inside reshard_flat): it must agree with the others'.
        new, stats = reshard_flat(
            {k: self.shards[k] for k in names},
            numel=self.numel,
            old_ranks=old_ranks,
            new_ranks=new_ranks,
            rank=self.rank,
            staging_bytes=staging_bytes,
            group=group,
            kinds=names,
        )
        self.shards.update(new)
        for k in names:
            self.kind_ranks[k] = tuple(sorted(new_ranks))
        return stats.to_dict()

    def reshard_in_background(self, new_ranks: tuple[int, ...], staging_bytes: int, kinds: list[str], tag: str) -> None:
        """Start a reshard of `kinds` in a thread (issue 4: optimizer state off the critical path)."""

        def run() -> None:
            try:
                self._bg_result = self.reshard(new_ranks, staging_bytes, kinds, tag)
            except BaseException as exc:  # surfaced by join_background
                self._bg_result = exc

        self._bg = threading.Thread(target=run, daemon=True)
        self._bg.start()

    def join_background(self) -> dict:
        self._bg.join(timeout=TIMEOUT_S)
        if isinstance(self._bg_result, BaseException):
            raise self._bg_result
        return self._bg_result

    def world_inits(self) -> int:
        return rendezvous.world_inits()


def start_world(num_devices: int) -> tuple[list, object, list[float]]:
    """Placement group, one actor per bundle, one gloo world; returns actors, pg, init seconds."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    pg = make_placement_group(num_devices, use_gpu=False, cpus_per_device=1.0, timeout_s=60.0)
    cls = ray.remote(CommActor)
    actors = [
        cls.options(**actor_options(pg, d, use_gpu=False, cpus_per_device=1.0)).remote(d, num_devices)
        for d in range(num_devices)
    ]
    init_method = ray.get(actors[0].address.remote())
    init_s = ray.get([a.init.remote(init_method) for a in actors], timeout=120)
    return actors, pg, init_s
