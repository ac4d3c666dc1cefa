"""Reward plug-ins: load `module:function` or `path/to/file.py:function`, tell its style, call it.

Three styles of reward function, as users already wrote them (`task.reward_style`; `auto`
reads the function's signature, `detect_style`):
- `dynaresize`: `fn(prompt, response, fields) -> float`, once per sample; `fields` holds the
  prompt record's other fields (for example a reference answer);
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)
  -> float | dict` with the score under "score", once per sample, called with keywords as
  verl's reward managers do;
- `trl`: `f(prompts, completions, **kwargs) -> list[float | None]`, once per prompt group, with
  `completion_ids`, `trainer_state` (its `global_step` only), `log_metric(name, value)` and
  every dataset column as a list, one entry per completion, as TRL's GRPOTrainer calls it
  (keywords the function does not take are left out when it has no `**kwargs`). Chat prompts
  come as message lists and completions as `[{"role": "assistant", "content": text}]`.
Any of them may be `async def`. A dict's other numeric keys and `log_metric`'s values are
reward metrics (their mean per step).

`invoke` is one call, in the process it runs in (a reward worker, `rl.reward_pool`); it returns
plain data: per sample a finite float, None (trl: leave the sample out) or the problem with it.

Invariants:
- `load_reward` raises `UserError` naming the spec for any spec that does not give a callable;
  `check_style` raises `UserError` when the function cannot be called as its style calls it.
- `score` returns a finite float, or (policy "zero") 0.0 with the reason, or (policy "fail")
  raises `RewardError`; it never lets a reward function's own exception escape unwrapped.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dynaresize.errors import RewardError, UserError

RewardFn = Callable[[str, str, dict], float]
ON_ERROR = ("fail", "zero")
STYLES = ("dynaresize", "verl", "trl")
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric")
_P = inspect.Parameter


def load_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`; a file path is resolved against the current directory."""
    return load_object(spec)


def load_object(spec: str, what: str = "reward", kind: str = "function") -> Any:
    """The callable named by `spec` (`module:name` or `path/to/file.py:name`); `what` and `kind`
    name it in the one-line `UserError` (a reward's function, an environment's class)."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise UserError(f"{what} {spec!r}: expected module:{kind} or path/to/file.py:{kind}")
    target, name = spec.rsplit(":", 1)
    if not target or not name.isidentifier():
        raise UserError(f"{what} {spec!r}: expected module:{kind} or path/to/file.py:{kind}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(spec, Path(target), what)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise UserError(f"{what} {spec!r}: module {exc.name!r} not found") from None
        except Exception as exc:  # the user's module failed while importing
            raise UserError(f"{what} {spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserError(f"{what} {spec!r}: {target} has no attribute {name!r}")
    if not callable(fn):
        raise UserError(f"{what} {spec!r}: {target}.{name} is not callable")
    return fn


def _load_file(spec: str, path: Path, what: str = "reward"):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise UserError(f"{what} {spec!r}: file {path} not found")
    # One module name per file path, so two reward files with the same stem do not collide.
    mod_name = "dynaresize_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UserError(f"{what} {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        raise UserError(f"{what} {spec!r}: loading {path} failed: {type(exc).__name__}: {exc}") from None
    sys.modules[mod_name] = module
    return module


def score(fn: RewardFn, prompt: str, response: str, fields: dict, on_error: str) -> tuple[float, str | None]:
    """(reward, None), or (0.0, reason) under on_error="zero"; under "fail" a bad reward raises RewardError."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    reason = None
    try:
        value = fn(prompt, response, fields)
    except Exception as exc:
        reason = f"raised {type(exc).__name__}: {exc}"
    else:
        if isinstance(value, numbers.Real):
            value = float(value)
            if not math.isfinite(value):
                reason = f"returned a non-finite value ({value})"
        else:
            reason = f"returned {type(value).__name__}, not a number"
    if reason is None:
        return value, None
    reason = " ".join(f"reward function {_name(fn)} {reason}".split())  # one line
    if on_error == "fail":
        raise RewardError(reason)
    return 0.0, reason


def _name(fn: object) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}:{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------- styles


def _signature(fn: Any, spec: str) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        raise UserError(f"task.reward={spec}: its signature cannot be read; set task.reward_style "
                        f"({', '.join(STYLES)})") from None


def detect_style(fn: Any, spec: str) -> tuple[str, str]:
    """(style, why) of a reward function, from the names of its parameters."""
    params = list(_signature(fn, spec).parameters.values())
    names = [p.name for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
    shown = f"({', '.join(names)})"
    if "solution_str" in names or {"data_source", "ground_truth"} <= set(names):
        return "verl", f"its parameters {shown} are verl's compute_score"
    if "completions" in names:
        return "trl", f"its parameters {shown} take TRL's completions"
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind == _P.VAR_POSITIONAL for p in params):
        return "dynaresize", f"its parameters {shown} take (prompt, response, fields)"
    raise UserError(f"task.reward={spec}: cannot tell its style from its parameters {shown}: expected "
                    "(prompt, response, fields), verl's (data_source, solution_str, ground_truth, extra_info) "
                    "or TRL's (prompts, completions, **kwargs); set task.reward_style")


def check_style(fn: Any, spec: str, style: str, columns: set[str]) -> None:
    """UserError unless `fn` can be called the way `style` calls it (`columns`: the dataset's
    fields, which a TRL function gets as keywords)."""
    sig = _signature(fn, spec)
    try:
        if style == "dynaresize":
            sig.bind("", "", {})
        elif style == "verl":
            sig.bind(data_source=None, solution_str="", ground_truth=None, extra_info={})
        else:
            sig.bind(**_accepted(sig, {k: [] for k in (*TRL_KEYWORDS, *sorted(columns))}))
    except TypeError as exc:
        how = {"dynaresize": "fn(prompt, response, fields)",
               "verl": "fn(data_source=, solution_str=, ground_truth=, extra_info=)",
               "trl": f"fn(prompts=, completions=, completion_ids=, trainer_state=, log_metric=, "
                      f"{', '.join(f'{c}=' for c in sorted(columns)) or 'no dataset columns'})"}[style]
        raise UserError(f"task.reward={spec}: the {style} style calls it as {how}, which its signature "
                        f"{sig} does not take ({exc})") from None


def _accepted(sig: inspect.Signature, kwargs: dict) -> dict:
    """The keywords a function takes: all of them with **kwargs, else those it names."""
    if any(p.kind == _P.VAR_KEYWORD for p in sig.parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in sig.parameters}


def invoke(fn: Any, style: str, call: dict) -> dict:
    """One call of `fn` in its style. `call`: {"step", "prompts", "completions",
    "completion_ids", "fields"} (one sample, or a TRL group). Returns {"values": [float or
    None], "problems": [str or None], "metrics": {name: [float]}}; the function's own
    exceptions propagate."""
    metrics: dict[str, list[float]] = {}
    n = len(call["completions"])
    if style == "trl":
        chat = bool(call["prompts"]) and isinstance(call["prompts"][0], list)
        completions = [[{"role": "assistant", "content": c}] for c in call["completions"]] if chat \
            else list(call["completions"])
        kwargs = {"prompts": list(call["prompts"]), "completions": completions,
                  "completion_ids": [list(i) for i in call["completion_ids"]],
                  "trainer_state": SimpleNamespace(global_step=call["step"]),
                  "log_metric": lambda name, value: _metric(metrics, str(name), value)}
        for key in sorted({k for f in call["fields"] for k in f}):
            kwargs.setdefault(key, [f.get(key) for f in call["fields"]])
        out = _await(fn(**_accepted(inspect.signature(fn), kwargs)))
        if hasattr(out, "tolist"):
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            return {"values": [None] * n, "problems": [f"returned {got}, not a list of {n} rewards"] * n,
                    "metrics": metrics}
        pairs = [(None, None) if v is None else _number(v) for v in out]
    else:
        (prompt,), (text,), (fields,) = call["prompts"], call["completions"], call["fields"]
        if style == "verl":
            gt = fields.get("ground_truth", (fields.get("reward_model") or {}).get("ground_truth"))
            out = _await(fn(data_source=fields.get("data_source"), solution_str=text, ground_truth=gt,
                            extra_info=dict(fields.get("extra_info") or {})))
        else:
            out = _await(fn(prompt, text, fields))
        if isinstance(out, dict):
            for key, value in out.items():
                if key != "score":
                    _metric(metrics, str(key), value)
            if "score" not in out:
                return {"values": [None], "problems": ['returned a dict without a "score" key'], "metrics": metrics}
            out = out["score"]
        pairs = [_number(out)]
    return {"values": [v for v, _ in pairs], "problems": [p for _, p in pairs], "metrics": metrics}


def _await(value: Any) -> Any:
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def _number(value: Any) -> tuple[float | None, str | None]:
    if isinstance(value, numbers.Real):
        value = float(value)
        return (value, None) if math.isfinite(value) else (None, f"returned a non-finite value ({value})")
    return None, f"returned {type(value).__name__}, not a number"


def _metric(metrics: dict[str, list[float]], name: str, value: Any) -> None:
    """A numeric value joins the metric's list; anything else is not a metric."""
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        metrics.setdefault(name, []).append(float(value))
