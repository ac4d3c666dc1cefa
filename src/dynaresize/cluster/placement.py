"""Ray placement of device workers: one bundle per device, packed, reserved before any actor.

A run reserves all its devices up front in one placement group (PACK: as few nodes as
possible, so most messages stay on a node), then pins worker `d` to bundle `d` for the whole
run. Reserving first turns "the cluster is too small" into one clear error at start instead
of actors pending forever.

Invariant: bundle index == device id == world rank of the worker placed in it.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dynaresize.errors import UserError


def _bundle(use_gpu: bool, cpus_per_device: float) -> dict[str, float]:
    bundle = {"CPU": float(cpus_per_device)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def make_placement_group(
    num_devices: int,
    *,
    use_gpu: bool,
    cpus_per_device: float = 1.0,
    timeout_s: float = 60.0,
    strategy: str = "PACK",
) -> PlacementGroup:
    """Reserve `num_devices` bundles (1 GPU and `cpus_per_device` CPUs each, or CPUs only).

    Raises UserError naming the shortfall when the cluster cannot hold them, either at once
    (its total resources are too small) or after `timeout_s` of waiting.
    """
    if num_devices < 1:
        raise UserError(f"devices: need at least 1, got {num_devices}")
    if cpus_per_device <= 0:
        raise UserError(f"cpus_per_device: must be > 0, got {cpus_per_device}")
    if not ray.is_initialized():
        raise RuntimeError("make_placement_group: call ray.init() first")
    need = _bundle(use_gpu, cpus_per_device)
    have = ray.cluster_resources()
    for resource, amount in need.items():
        total = amount * num_devices
        if have.get(resource, 0.0) < total:
            raise UserError(
                f"devices: {num_devices} devices need {total:g} {resource} but the Ray cluster has "
                f"{have.get(resource, 0.0):g}; use fewer devices or a larger cluster"
            )
    pg = placement_group([dict(need) for _ in range(num_devices)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise UserError(
            f"devices: could not reserve {num_devices} x {need} within {timeout_s:g}s "
            f"(cluster resources {dict(have)}; other jobs may hold them)"
        ) from None
    return pg


def actor_options(
    pg: PlacementGroup,
    bundle_index: int,
    *,
    use_gpu: bool,
    cpus_per_device: float = 1.0,
) -> dict:
    """Keyword arguments for `ActorClass.options(...)` that pin an actor to one bundle."""
    if not 0 <= bundle_index < pg.bundle_count:
        raise ValueError(f"bundle_index: {bundle_index} outside 0..{pg.bundle_count - 1}")
    return {
        "num_cpus": float(cpus_per_device),
        "num_gpus": 1 if use_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=False,
        ),
    }


def release_placement_group(pg: PlacementGroup) -> None:
    """Give the reserved bundles back (after the workers are gone)."""
    remove_placement_group(pg)
