"""Making a run config: coercion of plain data into the dataclasses of `config`, merging of
presets, files and `--set` overrides, and the resolved config as plain data.

How a config is made: a preset (a plain function returning a nested dict) -> an optional file
-> repeated `--set section.field=value` overrides -> `build_config(dict)`, which checks every
field (each section's own `check`), then the checks that need the cost models (the emulated
accelerator, `emulate.check`), and raises one `ConfigError` listing every bad field path and
value. The resolved config is `config_to_dict(cfg)`, saved with every run.

No Ray or torch; I/O only in `load_file` (reads a TOML/YAML/JSON file), in the `model.path`
check (`rl/model_path.py`: lists the folder, reads its config.json) and in `check_task` (the
dataset file exists).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from dynaresize.config import RunConfig, TaskConfig, TrainConfig, _Errors
from dynaresize.emulate.check import check_config
from dynaresize.errors import ConfigError
from dynaresize.rl.dataset import ROLES as DATASET_ROLES
from dynaresize.rl.env import env_spec
from dynaresize.rl.model_path import model_path_problem
from dynaresize.rl.rewards import STYLES as REWARD_STYLES


def _coerce(tp: Any, value: Any, path: str, err: _Errors) -> Any:
    """Convert `value` to the annotated type `tp`, or record an error and return None."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path, err)
    if origin is dict:  # a table from a file, or `key=value,key=value` from --set (task.columns)
        if isinstance(value, str):
            pairs = [part.partition("=") for part in value.split(",") if part.strip()]
            if not all(sep and k.strip() for k, sep, _ in pairs):
                err.add(path, value, "must be key=value,key=value")
                return None
            value = {k.strip(): v.strip() for k, _, v in pairs}
        if not isinstance(value, dict):
            err.add(path, value, "must be a table (key=value,key=value)")
            return None
        return {str(k): _coerce(typing.get_args(tp)[1], v, f"{path}.{k}", err) for k, v in value.items()}
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):  # "a,b" from --set is a list of any item type ("2,4,6": policy.allowed_rollout)
            value = [v for v in value.split(",") if v.strip()] if args[-1] is Ellipsis else value
        elif args[-1] is Ellipsis and isinstance(value, int) and not isinstance(value, bool):
            value = [value]  # --set policy.allowed_rollout=4 (YAML reads a lone number)
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


def _optional_section(tp: Any) -> type | None:
    """The dataclass of a `Section | None` field (a table that may be absent: train.lora), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


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
        if (section := _optional_section(tp)) is not None:  # null: off; a table: built and checked
            kwargs[f.name] = None if data[f.name] is None else _build_section(section, data[f.name], f"{path}{f.name}", err)
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


def _build_section(cls: type, data: Any, path: str, err: _Errors) -> Any:
    """An optional section's table, built as `_build` does; its required fields missing (or a
    value that is no table) are errors naming the field, never a TypeError."""
    if not isinstance(data, dict):
        err.add(path, data, "must be a table of fields (or null: off)")
        return None
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    for name in missing:
        err.add(f"{path}.{name}", None, "required")
    return None if missing else _build(cls, data, f"{path}.", err)


def field_paths(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf field of a config class as `section.field` (docs and tests walk them; an
    optional section's fields as `section.sub.field`)."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        section = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else _optional_section(hints[f.name])
        if section is not None:
            out += field_paths(section, f"{prefix}{f.name}.")
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
        for path, value, message in check_task(cfg) + check_algorithm(cfg):
            err.add(path, value, message)
    if err.lines:
        raise ConfigError(err.lines)
    return cfg


def check_algorithm(cfg: RunConfig) -> list[tuple[str, Any, str]]:
    """(path, value, message) for each `algorithm.*` / `reward.*` setting another section
    contradicts (rl/advantages.py, rl/dapo.py)."""
    out: list[tuple[str, Any, str]] = []
    t, al, rc, ob = cfg.train, cfg.algorithm, cfg.rollout, cfg.reward.overlong_buffer_len
    if al.adv_estimator != "grpo":  # the group std is GRPO's alone
        why = f"only grpo divides by the group std (algorithm.adv_estimator={al.adv_estimator})"
        if not t.norm_adv_by_std:
            out.append(("train.norm_adv_by_std", t.norm_adv_by_std, f"{why}: leave it true"))
        if t.adv_std != TrainConfig.adv_std:
            out.append(("train.adv_std", t.adv_std, f"{why}: leave it unset"))
    out += _check_workload_filter(cfg)
    if not al.filter_groups and rc.gen_prompts_per_step:
        out.append(("rollout.gen_prompts_per_step", rc.gen_prompts_per_step, "only used with algorithm.filter_groups=true"))
    if ob > rc.max_new_tokens:
        out.append(("reward.overlong_buffer_len", ob, f"must be <= rollout.max_new_tokens ({rc.max_new_tokens}): "
                    "the buffer is the budget's last tokens"))
    return out


def _check_workload_filter(cfg: RunConfig) -> list[tuple[str, Any, str]]:
    """`algorithm.filter_metric = workload` (rl/dapo.py) and emulated dynamic sampling: the
    length workload's model filters the groups, in generation batches of `prompts_per_step`
    prompts, up to the workload's own cap; an emulated run paces only that job (the simulator's),
    one-step-off or synchronous."""
    from dynaresize.rl.dapo import WORKLOAD_METRIC
    from dynaresize.workload import filter_spec

    al, rc, out = cfg.algorithm, cfg.rollout, []
    if not al.filter_groups:
        return out
    spec = filter_spec(rc.length_workload) if rc.synthetic_lengths else None
    if al.filter_metric == WORKLOAD_METRIC:
        if spec is None:
            out.append(("algorithm.filter_metric", al.filter_metric, "needs rollout.synthetic_lengths=true and a "
                        f"rollout.length_workload with a filtered share (got {rc.length_workload!r}; e.g. dapo-filter)"))
            return out
        if rc.gen_prompts_per_step not in (0, rc.prompts_per_step):
            out.append(("rollout.gen_prompts_per_step", rc.gen_prompts_per_step, "with algorithm.filter_metric=workload "
                        f"a generation batch is rollout.prompts_per_step ({rc.prompts_per_step}) prompts, as the workload models it"))
        if al.max_num_gen_batches != spec.max_gen_batches:
            out.append(("algorithm.max_num_gen_batches", al.max_num_gen_batches, "with algorithm.filter_metric=workload "
                        f"the workload's own cap ({spec.name}: {spec.max_gen_batches})"))
    elif cfg.cluster.emulate is not None:
        out.append(("algorithm.filter_metric", al.filter_metric, "with cluster.emulate only `workload` (the emulator "
                    "paces the generation batches the length workload's model filters, as the simulator does; a reward "
                    "metric's batches are not known to it)"))
    if cfg.cluster.emulate is not None and int(cfg.train.staleness) >= 2:
        out.append(("algorithm.filter_groups", True, "not with cluster.emulate and train.staleness >= 2 (the streaming "
                    "simulator does not model dynamic sampling)"))
    return out


def check_task(cfg: RunConfig) -> list[tuple[str, Any, str]]:
    """(path, value, message) for each bad `task.*` field (the dataset's file must exist; its rows
    are read and checked when the job loads it, before Ray starts: rl/dataset.py), and for
    evaluation of a task that has no built-in held-out prompts."""
    t, out = cfg.task, []

    def need(ok: bool, name: str, message: str) -> None:
        if not ok:
            out.append((f"task.{name}", getattr(t, name), message))

    need(t.on_reward_error in ("fail", "zero"), "on_reward_error", "must be fail or zero")
    need(t.reward is None or ":" in t.reward, "reward", "must be module:function or file.py:function")
    need(t.reward_style in ("auto", *REWARD_STYLES), "reward_style", f"must be auto, {', '.join(REWARD_STYLES)}")
    need(t.reward_workers >= 1, "reward_workers", "must be >= 1")
    need(math.isfinite(t.reward_timeout_s) and t.reward_timeout_s > 0, "reward_timeout_s", "must be > 0 (seconds)")
    need(t.dataset is None or t.prompts_file is None, "prompts_file", "the old name of task.dataset: set only task.dataset")
    path = t.dataset or t.prompts_file
    name = "dataset" if t.dataset is not None else "prompts_file"
    need(path is None or Path(path).is_file(), name, "file not found")
    need(path is None or t.name == TaskConfig.name, "name",
         f"unused with task.{name} (a dataset replaces the built-in task): leave task.name unset")
    need(path is not None or not t.columns, "columns", "only read with task.dataset")
    for role, column in t.columns.items():
        need(role in DATASET_ROLES, "columns", f"{role!r} is not a role (roles: {', '.join(DATASET_ROLES)})")
        need(bool(column), "columns", f"{role}= names no column")
    multi = env_spec(t) is not None  # a multi-turn task (rl/env.py)
    need(t.env is None or ":" in t.env, "env", "must be module:Class or file.py:Class")
    need(t.max_turns >= 1, "max_turns", "must be >= 1")
    need(t.max_total_tokens >= 0, "max_total_tokens", "must be >= 0 (0: the model's positions)")
    need(math.isfinite(t.env_timeout_s) and t.env_timeout_s > 0, "env_timeout_s", "must be > 0 (seconds)")
    for field_name in ("max_turns", "max_total_tokens", "env_timeout_s"):
        need(multi or getattr(t, field_name) == getattr(TaskConfig, field_name), field_name,
             "only read by a multi-turn task: set task.env (or task.name=agent-calc|agent-guess)")
    if multi:
        need(t.reward is None, "reward", "unused with a multi-turn task: the environment's step rewards are its reward")
        if cfg.eval.every_steps:
            out.append(("eval.every_steps", cfg.eval.every_steps, "evaluation of a multi-turn task is not built: "
                        "set eval.every_steps=0"))
        if cfg.rollout.synthetic_lengths:
            out.append(("rollout.synthetic_lengths", True, "a multi-turn task's turns end at EOS or when its "
                        "environment is done: set rollout.synthetic_lengths=false"))
        if cfg.cluster.emulate:
            out.append(("cluster.emulate", cfg.cluster.emulate, "emulated pacing of a multi-turn task is in the "
                        "simulator only (dynaresize simulate --workload agent-tools): leave it unset"))
    e = cfg.eval
    if e.every_steps and e.prompts_file is None and (path is not None or t.name.partition(":")[0] != TaskConfig.name):
        out.append(("eval.prompts_file", None, f"needed to evaluate a task from task.{name if path else 'name'}="
                    f"{path or t.name!r} (held-out prompts come built in only for the toy task)"))
    return out


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
