"""Multi-node pieces that need no Ray cluster: how the driver joins Ray, which worker holds the
off-node replica of each snapshot shard, node faults (parsing, refusal on the driver's node,
attribution of every device of the node to one fault), the checkpoint directory's ownership,
and the config fields."""

from __future__ import annotations

import json
import logging

import pytest

from dynaresize.cluster.faults import FaultInjector, parse_faults
from dynaresize.cluster.placement import init_kwargs
from dynaresize.cluster.snapshot import replica_holders
from dynaresize.config_load import build_config
from dynaresize.driver.checkpointing import OWNER, checkpoint_root, claim_root
from dynaresize.errors import ConfigError, UserError


def test_ray_init_joins_the_named_cluster_the_job_cluster_or_starts_a_local_one():
    assert init_kwargs("auto", 4, environ={})["address"] == "auto"
    assert init_kwargs("10.0.0.1:6379", 4, environ={"RAY_ADDRESS": "x"})["address"] == "10.0.0.1:6379"
    job = init_kwargs(None, 4, environ={"RAY_ADDRESS": "http://10.0.0.1:8265"})  # under `ray job submit`
    assert "address" not in job and "num_cpus" not in job  # ray.init() reads RAY_ADDRESS; sizing is not ours
    local = init_kwargs(None, 4, environ={})
    assert local["address"] == "local" and local["num_cpus"] == 4  # never joins a `ray start` cluster by accident


def test_replica_holders_are_on_another_node():
    nodes = ["a", "b", "a", "b"]
    assert replica_holders((2, 3), nodes) == {2: 3, 3: 0}
    assert replica_holders((0, 2), ["a", "a", "a", "b"]) == {0: 3, 2: 3}
    assert replica_holders((0, 1), ["a", "a", "a", "a"]) == {}  # one node: nowhere to replicate to
    for train in ((0, 1), (1, 2, 3), (3,)):
        held = replica_holders(train, nodes)
        assert all(nodes[h] != nodes[d] for d, h in held.items()) and set(held) == set(train)


def test_node_fault_explains_every_device_of_its_node_once():
    inj = FaultInjector(parse_faults(["node:3@train:1", "kill:0@train:2"], 4))
    inj.set_nodes(["a", "b", "a", "b"], driver_node="head")
    with pytest.raises(UserError, match="driver's node"):
        FaultInjector(parse_faults(["node:1@train:1"], 4)).set_nodes(["a", "head", "a", "b"], driver_node="head")
    assert inj.attribute(1) is None  # not fired yet
    inj.reach("train", 1, [2, 3], worker_of=lambda d: None, alive=lambda d: True)
    node_fault = inj.faults[0]
    assert inj.attribute(1) is node_fault and inj.attribute(3) is node_fault  # device 1 shares device 3's node
    assert inj.attribute(0) is None and inj.attribute(2) is None  # node a survived; kill:0 has not fired
    assert [a for a in inj.faults if a.attributed] == [node_fault]  # one fault, counted once
    assert inj.unfired() == ["kill:0@train:2"]
    with pytest.raises(ConfigError, match="expected KIND"):
        parse_faults(["crash:1@train:1"], 4)


def test_checkpoint_dir_belongs_to_one_run(tmp_path):
    run1, run2, shared = tmp_path / "r1", tmp_path / "r2", tmp_path / "shared"
    assert checkpoint_root(run1, None) == (run1 / "checkpoint").resolve()
    assert checkpoint_root(run1, str(shared)) == shared.resolve()
    claim_root(shared, run1)
    claim_root(shared, run1)  # the same run again (a resume): fine
    assert json.loads((shared / OWNER).read_text())["run_dir"] == str(run1.resolve())
    with pytest.raises(UserError, match="another run"):
        claim_root(shared, run2)


def test_config_fields_are_checked():
    cfg = build_config({"cluster": {"placement_strategy": "SPREAD"}, "checkpoint": {"dir": "/shared/ckpt"},
                        "faults": ["node:1@rollout:2"]})
    assert cfg.cluster.placement_strategy == "SPREAD" and cfg.checkpoint.dir == "/shared/ckpt"
    with pytest.raises(ConfigError) as e:
        build_config({"cluster": {"placement_strategy": "spread"}, "checkpoint": {"dir": " "}})
    assert "cluster.placement_strategy='spread'" in str(e.value) and "checkpoint.dir=' '" in str(e.value)


def test_worker_env_pins_threads_and_quiets_vllm_unless_the_user_set_its_level():
    from dynaresize.cluster.placement import worker_env

    env = worker_env(2, environ={})["runtime_env"]["env_vars"]
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert worker_env(1, environ={"VLLM_LOGGING_LEVEL": "DEBUG"})["runtime_env"]["env_vars"]["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_the_console_is_quiet_unless_the_log_level_is_raised():
    from dynaresize.cluster.placement import log_level, worker_env
    quiet, loud = init_kwargs(None, 2, environ={}), init_kwargs(None, 2, environ={"DYNARESIZE_LOG_LEVEL": "info"})
    assert (quiet["log_to_driver"], quiet["logging_level"]) == (False, logging.ERROR)
    assert (loud["log_to_driver"], loud["logging_level"]) == (True, logging.INFO)
    env = worker_env(1, environ={})["runtime_env"]["env_vars"]
    assert env["PYTHONWARNINGS"] == "ignore" and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    env = worker_env(1, environ={"DYNARESIZE_LOG_LEVEL": "debug"})["runtime_env"]["env_vars"]
    assert "PYTHONWARNINGS" not in env and "TORCH_CPP_LOG_LEVEL" not in env and env["VLLM_LOGGING_LEVEL"] == "INFO"
    kept = worker_env(1, environ={"PYTHONWARNINGS": "default", "TORCH_CPP_LOG_LEVEL": "INFO"})["runtime_env"]
    assert kept["env_vars"]["PYTHONWARNINGS"] == "default" and kept["env_vars"]["TORCH_CPP_LOG_LEVEL"] == "INFO"
    with pytest.raises(UserError, match="DYNARESIZE_LOG_LEVEL='loud'"):
        log_level({"DYNARESIZE_LOG_LEVEL": "loud"})


def test_survivors_of_a_lost_nccl_peer_get_an_exception_not_a_teardown():
    from dynaresize.cluster.placement import worker_env

    assert worker_env(1, environ={})["runtime_env"]["env_vars"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    kept = worker_env(1, environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})["runtime_env"]["env_vars"]
    assert kept["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_gpu_reservation_follows_the_clusters_resources_not_the_drivers_torch():
    """A driver on a CPU-only head over GPU worker nodes still reserves a GPU per device."""
    from dynaresize.cluster.placement import gpus_wanted

    assert gpus_wanted("auto", {"CPU": 64.0, "GPU": 16.0}) is True  # GPUs somewhere in the Ray cluster
    assert gpus_wanted("auto", {"CPU": 2.0}) is False and gpus_wanted("auto", {"CPU": 2.0, "GPU": 0.0}) is False
    assert gpus_wanted("nccl", {"CPU": 2.0}) is True  # asked for: Ray then waits for GPUs it has not
    assert gpus_wanted("gloo", {"CPU": 8.0, "GPU": 8.0}) is False
