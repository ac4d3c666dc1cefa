"""Making a run config: coercion of plain data into the dataclasses of `config`, merging of
presets, files and `--set` overrides, and the resolved config as plain data.

How a config is made: a preset (a plain function returning a nested dict) -> an optional file
-> repeated `--set section.field=value` overrides -> `build_config(dict)`, which checks every
field (each section's own `check`), then the checks that need the cost models (the emulated
accelerator, `emulate.check`), and raises one `ConfigError` listing every bad field path and
value. The resolved config is `config_to_dict(cfg)`, saved with every run.

No Ray or torch; I/O only in `load_file` (reads a TOML/YAML/JSON file) and in the `model.path`
check (`rl/model_path.py`: lists the folder, reads its config.json).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from dynaresize.config import RunConfig, _Errors
from dynaresize.emulate.check import check_config
from dynaresize.errors import ConfigError
from dynaresize.rl.model_path import model_path_problem


def _coerce(tp: Any, value: Any, path: str, err: _Errors) -> Any:
    """Convert `value` to the annotated type `tp`, or record an error and return None."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path, err)
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if args[-1] is Ellipsis and args[0] is str else value
        if not isinstance(value, (list, tuple)):
            err.add(path, value, "must be a list")
            return None
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            err.add(path, value, f"must have {len(item_types)} items")
            return None
        return tuple(_coerce(t, v, f"{path}[{i}]", err) for i, (t, v) in enumerate(zip(item_types, value)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        err.add(path, value, "must be true or false")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        err.add(path, value, "must be an integer")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            err.add(path, value, "must be a number")
            return None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        err.add(path, value, "must be a string")
        return None
    return value


def _build(cls: type, data: Any, path: str, err: _Errors) -> Any:
    if not isinstance(data, dict):
        err.add(path or "config", data, "must be a table of fields")
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = getattr(cls, "RENAMED_FIELDS", {})
    for key in data:
        if key in renamed:
            err.add(f"{path}{key}", data[key], f"renamed: use {path}{renamed[key]}")
        elif key not in names:
            err.add(f"{path}{key}", data[key], f"unknown field (known: {', '.join(sorted(names))})")
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], f"{path}{f.name}.", err)
            continue
        before = len(err.lines)
        value = _coerce(tp, data[f.name], f"{path}{f.name}", err)
        if len(err.lines) == before:
            kwargs[f.name] = value
    obj = cls(**kwargs)
    saved, err.prefix = err.prefix, path
    obj.check(err)
    err.prefix = saved
    return obj


def field_paths(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf field of a config class as `section.field` (docs and tests walk them)."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def build_config(data: dict, cls: type = RunConfig) -> Any:
    """Build and validate a config from a nested dict; raise ConfigError listing every problem."""
    err = _Errors()
    cfg = _build(cls, data, "", err)
    if isinstance(cfg, RunConfig):  # cross-checks that need the cost models (emulated accelerators)
        for path, value, message in check_config(cfg):
            err.add(path, value, message)
        if cfg.model.path is not None and (problem := model_path_problem(cfg.model.path)):
            err.add("model.path", cfg.model.path, problem)  # the folder's files (rl/model_path.py)
    if err.lines:
        raise ConfigError(err.lines)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The resolved config as plain JSON-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def merge(base: dict, top: dict) -> dict:
    """Deep-merge `top` over `base` (new dicts; inputs untouched)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.field=value` overrides; values are parsed as YAML scalars (1, 0.5, true)."""
    import yaml  # a declared dependency; imported here to keep module import light

    out = data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected section.field=value"])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node: dict = {}
        top = node
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        out = merge(out, top)
    return out


def load_file(path: str | Path) -> dict:
    """Read a TOML, YAML or JSON config file into a dict; a bad file is a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r}: not found"])
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # any parser's error becomes one line for the user
        raise ConfigError([f"config file {str(p)!r}: {type(exc).__name__}: {str(exc).splitlines()[0]}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config file {str(p)!r}: top level must be a table"])
    return data
