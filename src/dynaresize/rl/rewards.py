"""Reward plug-ins: load `module:function` or `path/to/file.py:function`, and score safely.

A reward function is called as `fn(prompt: str, response: str, fields: dict) -> float`, where
`fields` holds the prompt record's other fields (for example a reference answer).

Invariants:
- `load_reward` raises `UserError` naming the spec for any spec that does not give a callable.
- `score` returns a finite float, or (policy "zero") 0.0 with the reason, or (policy "fail")
  raises `RewardError`; it never lets a reward function's own exception escape unwrapped.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path

from dynaresize.errors import RewardError, UserError

RewardFn = Callable[[str, str, dict], float]
ON_ERROR = ("fail", "zero")


def load_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`; a file path is resolved against the current directory."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise UserError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    target, name = spec.rsplit(":", 1)
    if not target or not name.isidentifier():
        raise UserError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(spec, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise UserError(f"reward {spec!r}: module {exc.name!r} not found") from None
        except Exception as exc:  # the user's module failed while importing
            raise UserError(f"reward {spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserError(f"reward {spec!r}: {target} has no attribute {name!r}")
    if not callable(fn):
        raise UserError(f"reward {spec!r}: {target}.{name} is not callable")
    return fn


def _load_file(spec: str, path: Path):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise UserError(f"reward {spec!r}: file {path} not found")
    # One module name per file path, so two reward files with the same stem do not collide.
    mod_name = "dynaresize_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UserError(f"reward {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        raise UserError(f"reward {spec!r}: loading {path} failed: {type(exc).__name__}: {exc}") from None
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
