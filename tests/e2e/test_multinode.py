"""A real multi-node Ray cluster on one machine (Ray's own `ray.cluster_utils.Cluster`: a head
node that runs no workers and two worker nodes, each its own raylet and object store with 2 CPUs
and a custom resource naming it), and the loss of a whole node mid-run.

- placement: PACK puts the 4 device bundles on one node, SPREAD over both, STRICT_SPREAD with
  more devices than nodes is refused with a clear error;
- node loss: the job of _runs.py (4 devices, 4 deterministic steps) run by `dynaresize run` in
  its own process that finds the cluster in RAY_ADDRESS (as under `ray job submit`), with SPREAD
  and the fault `node:3@train:1` (device 3's node dies in training step 1: its raylet is killed,
  with its workers and its object store), ends on the surviving node: `ledger_ok`,
  `faults_recovered` counts the node once, the trainer state came back from the snapshot
  replicas on the other node, and every sample and the final parameters equal the
  uninterrupted run's. Checkpoints go to `checkpoint.dir`, a path every node sees.

Marked slow (`make test-faults`); about 2-3 minutes here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _runs import assert_same_run, job_data, records, reference_run

pytestmark = [pytest.mark.dist, pytest.mark.slow]

NODE_CPUS = 2


@pytest.fixture(scope="module")
def two_nodes():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {name: cluster.add_node(num_cpus=NODE_CPUS, resources={name: 1}, object_store_memory=200 << 20)
             for name in ("node_a", "node_b")}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster, {n.node_id: name for name, n in nodes.items()}
    ray.shutdown()
    cluster.shutdown()


def _two_alive(cluster, names: dict) -> None:
    """Add worker nodes until two are alive (a node-loss test kills one for good)."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    while len([nid for nid in names if nid in alive]) < 2:
        name = f"node_{len(names)}"
        node = cluster.add_node(num_cpus=NODE_CPUS, resources={name: 1}, object_store_memory=200 << 20)
        names[node.node_id] = name
        deadline = time.time() + 60  # not cluster.wait_for_nodes: it counts the killed node too
        while time.time() < deadline and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id):
            time.sleep(0.5)
        alive.add(node.node_id)


def _wait_all_cpus_free(timeout_s: float = 30.0) -> None:
    """Removing a placement group gives its resources back asynchronously: wait for them."""
    import ray

    deadline = time.time() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < 2 * NODE_CPUS and time.time() < deadline:
        time.sleep(0.2)


def test_placement_strategy_decides_the_nodes(two_nodes):
    from dynaresize.cluster.placement import bundle_nodes, make_placement_group, release_placement_group
    from dynaresize.errors import UserError

    _, names = two_nodes
    for strategy, want in (("PACK", 1), ("SPREAD", 2), ("STRICT_PACK", 1)):
        _wait_all_cpus_free()
        pg = make_placement_group(4, use_gpu=False, cpus_per_device=0.5, strategy=strategy)
        try:
            used = {names[n] for n in bundle_nodes(pg)}
        finally:
            release_placement_group(pg)
        assert len(used) == want, (strategy, used)
    with pytest.raises(UserError, match="STRICT_SPREAD: 4 devices need 4 nodes"):
        make_placement_group(4, use_gpu=False, cpus_per_device=0.5, strategy="STRICT_SPREAD")
    _wait_all_cpus_free()


@pytest.mark.parametrize("staleness", [1, 2])
def test_node_lost_mid_run_recovers_on_the_survivors(two_nodes, tmp_path, staleness):
    """Through the CLI in its own process, finding the cluster in RAY_ADDRESS as the driver of a
    `ray job submit` does, with the node fault, the strategy and the checkpoint path as a user
    gives them; one-step-off and streaming (staleness 2: requests in flight on the lost node are
    re-issued)."""
    import ray

    cluster, names = two_nodes
    _two_alive(cluster, names)  # the other case of this test killed one of the fixture's nodes
    out, shared = tmp_path / "run", tmp_path / "shared" / "ckpt"
    (tmp_path / "job.json").write_text(json.dumps(job_data()))
    _wait_all_cpus_free()
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "dynaresize", "run", "--no-progress", "--preset", "cpu", "--config",
                           str(tmp_path / "job.json"), "--out", str(out), "--inject", "node:3@train:1",
                           "--set", "cluster.placement_strategy=SPREAD", "--set", f"checkpoint.dir={shared}",
                           "--set", "checkpoint.every_steps=2", "--set", f"train.staleness={staleness}"],
                          env={**os.environ, "RAY_ADDRESS": cluster.address, "DYNARESIZE_LOG_LEVEL": "info"},
                          capture_output=True, text=True, timeout=600)
    run_s = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    # It joined this cluster, it did not start one (Ray says so at the raised log level).
    assert "Connected to Ray cluster" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())

    (place,) = records(out, "placement")
    assert place["strategy"] == "SPREAD" and place["num_nodes"] == 2
    assert len({names[n] for n in place["nodes"]}) == 2  # spread over both nodes
    lost_node = place["nodes"][3]
    on_lost = [d for d, n in enumerate(place["nodes"]) if n == lost_node]
    assert 3 in on_lost and len(on_lost) == 2

    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["faults_injected"] == 1 and summary["faults_recovered"] == 1  # the node, once
    assert summary["devices_final"] == 2 and summary["world_generation"] == 1 and not summary["faults_unfired"]
    faults = records(out, "fault")
    assert sorted(f["device"] for f in faults) == on_lost
    assert all((f["fault_kind"], f["point"], f["injected"], f["node"]) == ("node", "train", True, lost_node)
               for f in faults)
    (rec,) = records(out, "recovery")
    assert rec["lost_devices"] == on_lost and rec["lost_nodes"] == [lost_node] and rec["num_devices"] == 2
    assert rec["rehomed_shards"] >= 1  # the lost trainer's shards, re-made from their replicas
    # the node is gone for Ray too (its raylet was killed)
    deadline = time.time() + 60
    while time.time() < deadline and any(n["Alive"] for n in ray.nodes() if n["NodeID"] == lost_node):
        time.sleep(1)
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == lost_node)
    dead_after_s = time.time() - t0 - run_s

    # nothing lost: every training sample consumed once within the staleness bound ...
    consumed = [r for r in records(out, "sample") if r["consumed_step"] is not None]
    assert len({s["sample_id"] for s in consumed}) == len(consumed) == 4 * 16
    assert all(0 <= s["consumed_step"] - s["version"] <= staleness for s in consumed)
    # ... checkpoints where every node sees them (the run directory keeps the final HF model) ...
    assert json.loads((shared / "latest.json").read_text())["step"] == 4
    assert json.loads((shared / "owner.json").read_text())["run_dir"] == str(out.resolve())
    assert [c["cause"] for c in records(out, "checkpoint")] == ["periodic", "final"]
    assert not list((out / "checkpoint").glob("step-*")) and (out / "checkpoint" / "model.safetensors").is_file()
    # ... and the same tokens and final parameters as the uninterrupted run
    assert_same_run(out, reference_run(staleness=staleness))
    print(f"\nnode-loss run: {run_s:.1f}s; recovery_s {rec['recovery_s']:.2f} (settle {rec['settle_s']:.2f}, "
          f"world {rec['world_s']:.2f}, restore {rec['restore_s']:.2f} of which re-home {rec['rehome_s']:.2f} "
          f"for {rec['rehomed_shards']} shards); detect_s "
          f"{[round(f['detect_s'], 2) for f in faults]}; Ray had the node dead {dead_after_s:.1f}s after the run")
