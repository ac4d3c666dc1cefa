"""Ray placement of device workers: one bundle per device, reserved before any actor.

A run reserves all its devices up front in one placement group, then pins worker `d` to bundle
`d` for the whole run. Reserving first turns "the cluster is too small" into one clear error at
start instead of actors pending forever. The group's strategy is `cluster.placement_strategy`
(docs/cluster.md): PACK (default: as few nodes as possible, so most messages stay on a node),
SPREAD (over as many nodes as possible, best effort), STRICT_PACK (one node, or fail),
STRICT_SPREAD (every device on its own node, or fail). `bundle_nodes` says where each bundle
went; the run records it (`placement` record) and uses it for node faults and for keeping
trainer snapshots off their own node (cluster/snapshot.py).

`init_kwargs` is how the driver joins Ray: the configured address (`auto`: the cluster started
with `ray start` on this machine); else the cluster of a `ray job submit` (RAY_ADDRESS set by
the job); else a new local Ray sized for the run.

The console shows the run's own lines only: Ray's driver logging at ERROR, the workers' output
not forwarded, and the workers' third-party warnings (Python warnings, torch's C++ warnings,
vLLM's logging) off. `DYNARESIZE_LOG_LEVEL=info` (or `debug`) raises the level: Ray logs at
that level, every worker's output reaches the console, and warnings are shown. A level the user
set for vLLM (`VLLM_LOGGING_LEVEL`), torch (`TORCH_CPP_LOG_LEVEL`) or Python (`PYTHONWARNINGS`)
is kept either way.

Invariant: bundle index == device id == world rank of the worker placed in it (first world).
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dynaresize.errors import UserError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOG_LEVEL_ENV = "DYNARESIZE_LOG_LEVEL"  # info | debug: show Ray's and the workers' output (module docstring)
LOG_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


def log_level(environ: dict | None = None) -> int:
    """The run's log level from DYNARESIZE_LOG_LEVEL (default: error, the quiet console)."""
    env = os.environ if environ is None else environ
    name = str(env.get(LOG_LEVEL_ENV, "error")).strip().lower()
    if name not in LOG_LEVELS:
        raise UserError(f"{LOG_LEVEL_ENV}={name!r}: expected one of {', '.join(LOG_LEVELS)}")
    return LOG_LEVELS[name]


def init_kwargs(address: str | None, num_cpus: int, environ: dict | None = None) -> dict:
    """Keyword arguments for `ray.init` (see the module docstring). Pure: reads `environ`
    (default `os.environ`) only for RAY_ADDRESS and DYNARESIZE_LOG_LEVEL."""
    env = os.environ if environ is None else environ
    level = log_level(env)
    kwargs: dict = {"include_dashboard": False, "log_to_driver": level <= logging.INFO, "logging_level": level}
    if address:
        kwargs["address"] = address
    elif env.get("RAY_ADDRESS"):
        pass  # under `ray job submit`: ray.init() joins the job's cluster (sizing it is not ours)
    else:
        kwargs.update(address="local", num_cpus=num_cpus)  # never join a `ray start` cluster by accident
    return kwargs


def gpus_wanted(backend: str, cluster_resources: dict) -> bool:
    """Whether each device's bundle reserves a GPU: `cluster.backend` nccl, or auto on a Ray
    cluster that has GPUs. Decided by the cluster's resources, not the driver's torch: a driver
    on a CPU-only head node still reserves the GPU workers' devices."""
    if backend == "nccl":
        return True
    return backend == "auto" and float(cluster_resources.get("GPU", 0.0)) >= 1.0


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
    if strategy not in STRATEGIES:
        raise UserError(f"cluster.placement_strategy={strategy!r}: must be one of {', '.join(STRATEGIES)}")
    have = ray.cluster_resources()
    if strategy == "STRICT_SPREAD":
        nodes = [n for n in ray.nodes() if n.get("Alive") and all(n["Resources"].get(r, 0.0) >= a for r, a in need.items())]
        if len(nodes) < num_devices:
            raise UserError(f"cluster.placement_strategy=STRICT_SPREAD: {num_devices} devices need {num_devices} nodes "
                            f"with {need} each, the Ray cluster has {len(nodes)}; use SPREAD or fewer devices")
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
            f"devices: could not reserve {num_devices} x {need} with strategy {strategy} within {timeout_s:g}s "
            f"(cluster resources {dict(have)}; other jobs may hold them, or no node fits the strategy)"
        ) from None
    return pg


def worker_env(torch_threads: int, environ: dict | None = None) -> dict:
    """The runtime env every device worker gets (the elastic cluster and the naive baseline
    alike, so both compute with the same settings): the math thread count pinned in the
    environment too (Ray may run methods on threads other than the one __init__ ran on, and
    thread counts change fp32 results), and third-party warnings off unless the log level is
    raised (module docstring): vLLM's logging at ERROR (its per-engine INFO lines would drown the
    run's output), torch's C++ warnings at ERROR, Python warnings ignored. A level the user set
    for any of them is kept.

    NCCL's asynchronous error handling is set to abort the communicator only
    (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`): torch's default tears the process down when the
    watchdog sees a lost peer, so the survivors would die too, while recovery
    (driver/recovery.py) expects each survivor to get an exception and re-form the world."""
    environ = os.environ if environ is None else environ
    threads = str(torch_threads)
    quiet = log_level(environ) > logging.INFO
    env_vars = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": environ.get("VLLM_LOGGING_LEVEL", "ERROR" if quiet else "INFO")}
    env_vars["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    for key, value in (("TORCH_CPP_LOG_LEVEL", "ERROR"), ("PYTHONWARNINGS", "ignore")):
        if key in environ:
            env_vars[key] = environ[key]
        elif quiet:
            env_vars[key] = value
    return {"runtime_env": {"env_vars": env_vars}}


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


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """The Ray node id of every bundle of a ready placement group, by bundle index."""
    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return [str(table[i]) for i in range(pg.bundle_count)]


def node_names() -> dict[str, str]:
    """Ray node id -> a short readable name: `head` for the head node, else its IP and the
    first 8 hex digits of its id (several nodes may share an IP)."""
    out = {}
    for n in ray.nodes():
        head = "node:__internal_head__" in n.get("Resources", {})
        out[n["NodeID"]] = "head" if head else f"{n.get('NodeManagerAddress', '?')}/{n['NodeID'][:8]}"
    return out


def node_addresses() -> dict[str, tuple[str, int]]:
    """Ray node id -> (address, port) of its raylet, for the live nodes (read once at start)."""
    return {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in ray.nodes() if n.get("Alive")}


def nodes_down(addresses: dict[str, tuple[str, int]], node_ids, timeout_s: float = 1.0) -> set[str]:
    """The nodes among `node_ids` whose raylet is gone: Ray already says so, or its port refuses
    a connection (or none comes within `timeout_s`). Asking the raylet itself is immediate, where
    Ray's own verdict waits for its health checks to fail (seconds to tens of seconds)."""
    import socket

    gcs = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
    down = set()
    for node in set(node_ids):
        if gcs.get(node) is False or node not in addresses:
            down.add(node)
            continue
        try:
            socket.create_connection(addresses[node], timeout=timeout_s).close()
        except OSError:
            down.add(node)
    return down


def release_placement_group(pg: PlacementGroup) -> None:
    """Give the reserved bundles back (after the workers are gone)."""
    remove_placement_group(pg)
