import pytest

from dynaresize.config import RunConfig, parse_fault, parse_schedule
from dynaresize.config_load import apply_overrides, build_config, config_to_dict, load_file
from dynaresize.errors import ConfigError


def test_defaults_build_and_round_trip():
    cfg = build_config({})
    assert isinstance(cfg, RunConfig)
    again = build_config(config_to_dict(cfg))
    assert again == cfg


def test_every_error_is_listed_with_path_and_value():
    with pytest.raises(ConfigError) as info:
        build_config({"cluster": {"devices": "x", "bogus": 1}, "policy": {"name": "nope"}, "steps": 0})
    text = "\n".join(info.value.errors)
    assert "cluster.devices='x'" in text
    assert "cluster.bogus=1" in text
    assert "policy.name='nope'" in text
    assert "steps=0" in text
    assert len(info.value.errors) == 4


def test_overrides_are_typed_and_nested():
    data = apply_overrides({}, ["policy.name=static:2", "train.lr=1e-3", "cluster.devices=6", "deterministic=true"])
    cfg = build_config(data)
    assert cfg.policy.name == "static:2"
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.cluster.devices == 6
    assert cfg.deterministic is True


def test_bad_override_syntax():
    with pytest.raises(ConfigError):
        apply_overrides({}, ["novalue"])


def test_schedule_and_fault_parsing():
    assert parse_schedule("2:3,4:1") == ((2, 3), (4, 1))
    with pytest.raises(ValueError):
        parse_schedule("4:1,2:3")
    with pytest.raises(ValueError):
        parse_schedule("x")
    f = parse_fault("kill:1@resize.reshard:3")
    assert (f.kind, f.device, f.point, f.step) == ("kill", 1, "resize.reshard", 3)
    with pytest.raises(ValueError):
        parse_fault("explode:1@train:3")


def test_load_file_formats(tmp_path):
    (tmp_path / "a.toml").write_text("steps = 5\n[cluster]\ndevices = 3\n")
    (tmp_path / "b.yaml").write_text("steps: 6\n")
    (tmp_path / "c.toml").write_text("steps = = 5\n")
    assert build_config(load_file(tmp_path / "a.toml")).cluster.devices == 3
    assert build_config(load_file(tmp_path / "b.yaml")).steps == 6
    with pytest.raises(ConfigError) as info:
        load_file(tmp_path / "c.toml")
    assert "c.toml" in info.value.errors[0]
    with pytest.raises(ConfigError):
        load_file(tmp_path / "missing.toml")
