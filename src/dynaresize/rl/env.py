"""Multi-turn environments: the protocol, loading one by name, calling it under a deadline, and a
tool-calling helper on top (docs/tasks.md, "Multi-turn and tools").

The protocol (`task.env = "module:Class"` or `"path/to/file.py:Class"`): a class built with no
arguments, one instance per trajectory, with

    reset(sample) -> observation | None
    step(action_text) -> (observation | None, reward, done)

either of which may be `async def`. `sample` is the prompt record (its `prompt` and every other
field of the dataset row). An observation is text (appended as its tokens) or chat messages
(`[{"role": "tool", "content": "42"}]`, rendered with the chat template as a continuation);
`reset`'s, when not None, follows the prompt before the model's first turn. `action_text` is
the model's turn decoded (special tokens removed). The trajectory's reward is the sum of its
steps' rewards. An environment must be a function of (sample, actions so far): a trajectory
that moves to another device is replayed there (`reset`, then `step` with each finished turn's
action) to rebuild the environment's state, and the replay must not end it early.

Failures: an environment that raises, returns something else than (observation, number, bool),
or takes longer than `task.env_timeout_s` for one call ends its trajectory with the reason
(`EnvFailure`); the driver then follows `task.on_reward_error` (fail the step, or score it 0
with the reason in the ledger), as for a reward error. A call past its deadline is abandoned:
its thread is a daemon and is never joined.

`ToolEnv` is the tool-calling helper: a subclass names its functions (`tools`) and how a final
answer scores (`score`); the model calls a tool by writing
`<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>` (the Hermes /
Qwen format), the result comes back as a `tool` message, and a turn without a tool call is the
final answer.

Pure apart from the threads that run environment calls; no torch.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import re
import threading
from concurrent.futures import Future
from typing import Any, Callable

from dynaresize.errors import UserError
from dynaresize.rl.rewards import load_object

Observation = Any  # str | list[dict] | None
AGENT_ENVS = {"agent-calc": "dynaresize.rl.agent_task:CalculatorEnv",
              "agent-guess": "dynaresize.rl.agent_task:GuessEnv"}  # built-in multi-turn tasks
STOP_REASONS = ("done", "max_turns", "max_total_tokens", "env_error")


class EnvFailure(Exception):
    """An environment call failed (raised, timed out, returned a bad value): the reason."""


def env_spec(task_cfg: Any) -> str | None:
    """The environment a task runs (`task.env`, else a built-in multi-turn task's), or None
    for a single-turn task."""
    return task_cfg.env or AGENT_ENVS.get(task_cfg.name.partition(":")[0])


def load_env(spec: str) -> type:
    """The environment class named by `spec` (UserError, one line, naming the spec otherwise)."""
    cls = load_object(spec, what="task.env", kind="Class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise UserError(f"task.env {spec!r}: not an environment class (needs reset(sample) and step(action_text); "
                        f"missing: {', '.join(missing) or 'a class'})")
    return cls


def run_call(fn: Callable, *args: Any) -> Any:
    """Call `fn(*args)`; a coroutine is run to its end on an event loop of this thread."""
    out = fn(*args)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def check_step(out: Any) -> tuple[Observation, float, bool]:
    """`step`'s return value as (observation, reward, done), or EnvFailure saying what is wrong."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise EnvFailure(f"step returned {type(out).__name__}, not (observation, reward, done)")
    obs, reward, done = out
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvFailure(f"step returned reward {reward!r}, not a finite number")
    check_observation(obs)
    return obs, float(reward), bool(done)


def check_observation(obs: Any) -> None:
    ok = obs is None or isinstance(obs, str) or (
        isinstance(obs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in obs))
    if not ok:
        raise EnvFailure(f"observation {str(obs)[:80]!r} is neither text nor chat messages")


def in_thread(fn: Callable[[], Any]) -> Future:
    """`fn()` on a daemon thread of its own; its result or exception in the future."""
    fut: Future = Future()

    def body() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the caller, never raised on this thread
            fut.set_exception(exc)

    threading.Thread(target=body, daemon=True, name="dynaresize-env").start()
    return fut


def failure(spec: str, what: str, exc: BaseException) -> str:
    """One line: which environment, which call, what went wrong."""
    detail = str(exc) if isinstance(exc, EnvFailure) else f"raised {type(exc).__name__}: {exc}"
    return " ".join(f"environment {spec} {what} {detail}".split())


# ---------------------------------------------------------------- tool calling

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_call(text: str) -> tuple[str, dict] | str | None:
    """The first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of `text`: (name,
    arguments), or a string saying why it is malformed, or None when there is none."""
    m = TOOL_CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except ValueError as exc:
        return f"the tool call is not JSON ({exc})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "the tool call names no tool"
    args = call.get("arguments", {})
    return (call["name"], args) if isinstance(args, dict) else "the tool call's arguments are not an object"


class ToolEnv:
    """An environment whose model calls functions (see the module docstring). Subclasses set
    `tools` (name -> function taking the JSON arguments as keywords, returning something
    printable) and define `score(answer_text) -> float`; `self.sample` is the prompt record and
    `self.calls` the (name, arguments, result) of the tool calls made so far. A malformed call
    or a tool that raises gives the model an error message as the tool's result."""

    tools: dict[str, Callable[..., Any]] = {}

    def reset(self, sample: dict) -> Observation:
        self.sample, self.calls = sample, []
        return None

    def step(self, action: str) -> tuple[Observation, float, bool]:
        call = parse_tool_call(action)
        if call is None:
            return None, float(self.score(action)), True
        if isinstance(call, str):
            result = f"error: {call}"
        elif call[0] not in self.tools:
            result = f"error: no tool {call[0]!r} (tools: {', '.join(sorted(self.tools))})"
        else:
            try:
                result = str(self.tools[call[0]](**call[1]))
            except Exception as exc:  # the model's bad arguments: its own problem, told back
                result = f"error: {type(exc).__name__}: {exc}"
            self.calls.append((call[0], call[1], result))
        return [{"role": "tool", "content": result}], 0.0, False

    def score(self, answer: str) -> float:
        raise NotImplementedError
