"""rollout.engine and the rollout.vllm_* fields: values, refusals (one line, exit 2), resolution,
and that each vllm_* setting reaches the arguments the vLLM engine is created with.

No engine is started here (tests/dist/test_rollout_vllm.py starts real ones); "installed" and
"importable" are monkeypatched, so these run the same with or without vllm.
"""

import importlib.util

import pytest

from dynaresize.cli import main
from dynaresize.config_load import build_config, config_to_dict
from dynaresize.errors import ConfigError, UserError
from dynaresize.roles import base, factory
from dynaresize.roles.vllm_memory import CPU_KV_CACHE_BYTES


@pytest.fixture
def no_vllm(monkeypatch):
    """vllm looks not installed (find_spec) and not importable."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(base, "_import_error", ["the vllm package is not installed"])


@pytest.fixture
def have_vllm(monkeypatch):
    """vllm looks installed and importable (nothing is imported)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(base, "_import_error", [None])


def _cfg(**rollout):
    return build_config({"rollout": rollout})


def test_defaults_and_round_trip():
    r = build_config({}).rollout
    assert (r.engine, r.vllm_max_num_seqs, r.vllm_max_model_len, r.vllm_kv_cache_bytes) == ("auto", 64, 0, 0)
    data = config_to_dict(build_config({}))
    assert "backend" not in data["rollout"]  # the temporary property is not saved
    assert build_config(data) == build_config({})


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_engine_values_without_vllm(no_vllm, engine):
    assert _cfg(engine=engine).rollout.engine == engine


def test_vllm_accepted_where_installed(have_vllm):
    assert _cfg(engine="vllm").rollout.engine == "vllm"


def test_bad_engine_value_names_the_field():
    with pytest.raises(ConfigError) as info:
        _cfg(engine="sglang")
    assert info.value.errors == ["rollout.engine='sglang': must be one of auto, vllm, hf"]


def test_old_backend_key_is_refused_naming_the_new_field():
    with pytest.raises(ConfigError) as info:
        _cfg(backend="hf")
    assert info.value.errors == ["rollout.backend='hf': renamed: use rollout.engine"]


def test_vllm_not_installed_is_one_line(no_vllm):
    with pytest.raises(ConfigError) as info:
        _cfg(engine="vllm")
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith("rollout.engine='vllm': the vllm package is not installed")


@pytest.mark.parametrize("args, needle", [
    (["--set", "rollout.engine=vllm"], "rollout.engine='vllm': the vllm package is not installed"),
    (["--set", "rollout.backend=hf"], "rollout.backend='hf': renamed: use rollout.engine"),
])
def test_cli_refusals_exit_2_with_one_line(no_vllm, tmp_path, capsys, args, needle):
    code = main(["run", "--no-progress", "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("field, value, needle", [
    ("vllm_max_num_seqs", 0, "must be >= 1"),
    ("vllm_max_model_len", -1, "must be 0"),
    ("vllm_max_model_len", 1, "must be 0"),
    ("vllm_kv_cache_bytes", 1000, "must be 0"),
    ("vllm_kv_cache_bytes", -5, "must be 0"),
    ("vllm_max_num_seqs", "many", "must be an integer"),
])
def test_vllm_fields_are_validated(field, value, needle):
    with pytest.raises(ConfigError) as info:
        _cfg(**{field: value})
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith(f"rollout.{field}={value!r}") and needle in info.value.errors[0]


def test_resolve_engine(no_vllm, monkeypatch):
    assert base.resolve_engine(_cfg(engine="hf")) == "hf"
    assert base.resolve_engine(_cfg(engine="auto")) == "hf"  # not importable
    monkeypatch.setattr(base, "_import_error", [None])  # importable from here on
    monkeypatch.setattr(base, "host_memory_bytes", lambda: 1 << 40)  # room for every device's engine
    assert base.resolve_engine(_cfg(engine="auto")) == "vllm"
    det = build_config({"deterministic": True})
    assert base.resolve_engine(det) == "hf"  # only hf log-probs are batch-invariant bit for bit
    small_heads = build_config({"model": {"hidden_size": 64, "num_heads": 4}})  # head size 16
    assert base.resolve_engine(small_heads) == "hf"
    assert base.resolve_engine(build_config({}).rollout) == "hf"  # a bare RolloutConfig: no model known


def test_auto_is_hf_where_one_cpu_engine_per_device_would_not_fit(have_vllm, monkeypatch):
    monkeypatch.setattr(base, "_cuda_available", lambda: False)
    monkeypatch.setattr(base, "host_memory_bytes", lambda: 24 << 30)
    six = build_config({"cluster": {"devices": 6, "rollout_devices": 3}})
    sixteen = build_config({"cluster": {"devices": 16, "rollout_devices": 8}})
    assert base.resolve_engine(six) == "vllm" and base.auto_hf_reason(six) is None  # 6 x 1.8 GiB fits in 75% of 24
    assert base.resolve_engine(sixteen) == "hf"
    assert "16 CPU vLLM engines would need ~29 GiB" in base.auto_hf_reason(sixteen)
    forced = build_config({"cluster": {"devices": 16, "rollout_devices": 8}, "rollout": {"engine": "vllm"}})
    assert base.resolve_engine(forced) == "vllm"  # asked for by name: the user's call
    monkeypatch.setattr(base, "_cuda_available", lambda: True)
    assert base.resolve_engine(sixteen) == "vllm"  # GPU engines do not live in host memory


def test_resolve_engine_refuses_vllm_where_it_cannot_run(have_vllm, monkeypatch):
    cfg = build_config({"rollout": {"engine": "vllm"}, "model": {"hidden_size": 64, "num_heads": 4}})
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm': attention head size 16"):
        base.resolve_engine(cfg)
    vllm_cfg = _cfg(engine="vllm")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="not installed"):
        base.resolve_engine(vllm_cfg)  # uninstalled after the config was built (another machine)


def test_resolved_engine(have_vllm):
    assert base.resolve_engine(_cfg(engine="hf")) == "hf"
    assert base.resolve_engine(_cfg(engine="vllm")) == "vllm"


def test_vllm_settings_reach_the_engine_arguments(have_vllm):
    pytest.importorskip("torch")
    from dynaresize.roles.rollout_vllm import VLLMRolloutEngine

    cfg = build_config({"seed": 7, "rollout": {"engine": "vllm", "vllm_max_num_seqs": 5,
                                               "vllm_max_model_len": 300, "vllm_kv_cache_bytes": 3 << 20,
                                               "temperature": 0.5}})
    eng = factory.rollout_engine_from_config(cfg)
    assert isinstance(eng, VLLMRolloutEngine) and not eng.loaded
    kw = eng.engine_kwargs()
    assert (kw["max_num_seqs"], kw["max_model_len"], kw["kv_cache_memory_bytes"]) == (5, 300, 3 << 20)
    assert (kw["seed"], kw["enable_prefix_caching"], eng.temperature) == (7, True, 0.5)
    assert kw["enable_chunked_prefill"] is False and kw["logprobs_mode"] == "processed_logprobs"
    auto_sized_cfg = build_config({"rollout": {"engine": "vllm", "vllm_max_model_len": 0, "vllm_kv_cache_bytes": 0}})
    auto_sized = factory.rollout_engine_from_config(auto_sized_cfg)
    r = auto_sized_cfg.rollout
    assert auto_sized.engine_kwargs()["max_model_len"] == r.max_prompt_tokens + r.max_new_tokens  # the run's budget
    assert auto_sized.engine_kwargs()["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES  # CPU: a fixed budget
    from unittest import mock

    with mock.patch.object(VLLMRolloutEngine, "_sleep_mode", staticmethod(lambda: True)):  # CUDA seen
        kw = auto_sized.engine_kwargs()
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85  # vLLM sizes it


def test_a_kv_cache_too_small_for_one_request_is_one_line(have_vllm):
    pytest.importorskip("torch")
    cfg = build_config({"rollout": {"engine": "vllm", "vllm_kv_cache_bytes": 1 << 20, "vllm_max_model_len": 4000},
                        "model": {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 4, "num_layers": 8}})
    with pytest.raises(UserError, match=r"vllm_kv_cache_bytes=1048576 holds \d+ tokens .* max_model_len 4000"):
        factory.rollout_engine_from_config(cfg).engine_kwargs()


def test_hf_engine_from_config(no_vllm):
    pytest.importorskip("torch")
    from dynaresize.roles.rollout_hf import HFRolloutEngine

    eng = factory.rollout_engine_from_config(_cfg(engine="auto", batch_rows=8))
    assert isinstance(eng, HFRolloutEngine) and eng.batch_rows == 8


def test_vllm_engine_refuses_small_heads():
    pytest.importorskip("torch")
    from dynaresize.roles.rollout_vllm import VLLMRolloutEngine

    with pytest.raises(UserError, match="head size 16"):
        VLLMRolloutEngine(build_config({"model": {"hidden_size": 64, "num_heads": 4}}).model, 1.0)


def test_a_torch_without_the_c10d_internals_vllm_world_needs_is_one_clear_error():
    from types import SimpleNamespace

    from torch.distributed import distributed_c10d

    from dynaresize.roles import vllm_world

    assert vllm_world.internals_problem() is None  # the installed torch has them
    world = SimpleNamespace(**{f: getattr(distributed_c10d._world, f) for f in vllm_world.WORLD_FIELDS
                               if f != "pg_coalesce_state"})
    fake = SimpleNamespace(_world=world, _update_default_pg=distributed_c10d._update_default_pg)
    problem = vllm_world.internals_problem(fake)
    assert "distributed_c10d._world.pg_coalesce_state" in problem and "roles/vllm_world.py" in problem
    assert "_update_default_pg" in vllm_world.internals_problem(SimpleNamespace(_world=world))


def test_kv_budget_arithmetic():
    from types import SimpleNamespace

    from dynaresize.roles.vllm_memory import kv_bytes_per_token, kv_cache_bytes, kv_problem

    qwen7b = SimpleNamespace(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584, num_hidden_layers=28)
    assert kv_bytes_per_token(qwen7b, "bfloat16") == 2 * 28 * 4 * 128 * 2  # 57,344 bytes/token
    assert kv_cache_bytes(0, cuda=True) is None and kv_cache_bytes(0, cuda=False) == CPU_KV_CACHE_BYTES
    assert kv_cache_bytes(5 << 20, cuda=True) == 5 << 20
    assert kv_problem(None, 57344, 10**6) is None  # vLLM sizes it and checks itself
    assert kv_problem(57344 * 100, 57344, 100) is None
    assert "holds 99 tokens" in kv_problem(57344 * 100 - 1, 57344, 100)


def test_cuda_engine_arguments_tp_all_reduce_and_graphs(have_vllm):
    """On CUDA a TP rank turns vLLM's custom all-reduce off (each rank's actor sees only its own
    GPU, so the peers' buffers it would open by TP rank are not visible) and CUDA graphs are on
    unless deterministic; on the CPU the engine stays eager and the all-reduce is left alone."""
    pytest.importorskip("torch")
    from unittest import mock

    from dynaresize.roles import vllm_tp
    from dynaresize.roles.base import TPPlacement
    from dynaresize.roles.rollout_vllm import VLLMRolloutEngine

    tp = TPPlacement(size=2, rank=1, master_addr="127.0.0.1", master_port=29555)
    cfg = build_config({"rollout": {"engine": "vllm"}})
    det = build_config({"rollout": {"engine": "vllm"}, "deterministic": True})
    assert vllm_tp.tp_engine_kwargs(tp, cuda=True)["disable_custom_all_reduce"] is True
    assert "disable_custom_all_reduce" not in vllm_tp.tp_engine_kwargs(tp, cuda=False)
    assert vllm_tp.tp_engine_kwargs(None, cuda=True) == {}  # one rank: nothing to all-reduce
    cpu = factory.rollout_engine_from_config(cfg, tp=tp).engine_kwargs()
    assert cpu["enforce_eager"] is True and "disable_custom_all_reduce" not in cpu
    with mock.patch.object(VLLMRolloutEngine, "_sleep_mode", staticmethod(lambda: True)), \
            mock.patch.object(vllm_tp, "_cuda", lambda: True):
        cuda = factory.rollout_engine_from_config(cfg, tp=tp).engine_kwargs()
        cuda_det = factory.rollout_engine_from_config(det, tp=tp).engine_kwargs()
    assert cuda["disable_custom_all_reduce"] is True and cuda["tensor_parallel_size"] == 2
    assert cuda["enforce_eager"] is False and cuda_det["enforce_eager"] is True
