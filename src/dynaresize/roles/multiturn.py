"""Multi-turn rollouts around a stepping engine: the turn loop of a rollout worker (issue 24).

Where it runs: on the rollout worker, around its engine (`SteppingEngine`), so it serves both
engines and both pipelines (`DeviceWorker.generate`, one-step-off and evaluation, and
`DeviceWorker.serve`, streaming). `TurnEngine(engine, loop)` is itself a `SteppingEngine`: a
request with `env_sample` is a trajectory, the others pass straight to the engine. A trajectory
alternates model turns (one engine request each, same sample id) with environment calls;
environment calls run on threads of their own (`rl.env.in_thread`), never on the engine's, so
the engine keeps stepping the other requests while one waits, and environment code never
issues collectives. With nothing to decode, `step` waits for the first environment call to end
(at most `ENV_POLL_S`).

Token in, token out. A trajectory is the exact token sequence after its prompt: each model
turn's tokens as the engine produced them (never decoded and encoded again), then the
observation's tokens (text encoded as is; chat messages rendered with the chat template as a
continuation of the conversation), and so on. `loss_mask` is 1 on the model's tokens and 0 on
the observations'; observation tokens carry log-prob 0.0 and the trainer ignores them.

Seeds: turn k of sample s samples with `turn_seed(seed_s, k)` (turn 0 with the sample's own
seed), so the tokens depend on the sample id, the weights and the observations alone: a
trajectory moved or re-run gives the same tokens (deterministic mode: a run with resizes equals
a static run). A turn resumed from a partial prefix of n tokens continues on the stream
`seed + RESUME_SEED_STRIDE * n`, as a single-turn request does (cluster/worker_serve.py).

Limits: at most `max_turns` model turns (an environment step follows every turn; one that is
not done after the last ends the trajectory, `max_turns`), and at most `max_total_tokens`
tokens in prompt + turns + observations (a turn is capped at what is left, an observation cut
at it: `max_total_tokens`). Every model turn's cap is the request's `max_new_tokens`.

Moving (`moved`): a trajectory leaves with its history in the prefix fields of its request
(tokens, log-probs, mask, finished turns; with `keep` also the current turn's tokens so far).
The receiving worker rebuilds the environment by replay (`reset`, then `step` of each finished
turn's action: environments are functions of (sample, actions), rl/env.py) and goes on from
there; the result is the same trajectory.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from dynaresize.rl.env import EnvFailure, check_observation, check_step, failure, in_thread, run_call
from dynaresize.rl.seeds import derived_seed
from dynaresize.roles.base import GenRequest, GenResult, SampleId

ENV_POLL_S = 0.01  # longest `step` waits for an environment call when nothing decodes
RESUME_SEED_STRIDE = 1_000_003  # as cluster/worker_serve.py: a resumed turn's own sampling stream


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of model turn `turn` (0-based) of a sample seeded `seed`."""
    return int(seed) if turn == 0 else derived_seed(int(seed), "turn", int(turn))


@dataclass
class Trajectory:
    """One multi-turn sample on this worker (see the module docstring)."""

    request: GenRequest  # as it came (its prefix: the history it brought)
    ids: list[int]  # after the prompt: model and observation tokens
    mask: list[int]
    logprobs: list[float]
    turns: list[tuple[int, int]]  # (start, end) of each finished model turn in `ids`
    turn_start: int  # where the current model turn starts in `ids`
    t0: float = field(default_factory=time.perf_counter)
    env: Any = None
    reward: float = 0.0
    call: cf.Future | None = None  # the environment call in flight
    call_kind: str = ""  # reset | step
    deadline: float = 0.0
    in_engine: bool = False  # a model turn is decoding
    version: int = -1  # the engine's version at its first turn here
    stop_reason: str = ""
    error: str | None = None


class TurnLoop:
    """The trajectories of one worker and their environment calls (see the module docstring).

    Args:
        env_cls: the environment class (one instance per trajectory).
        spec: its name, for failure reasons.
        decode: model tokens -> the action text the environment gets.
        encode: an observation (text or chat messages) -> its tokens.
        max_turns, max_total_tokens, timeout_s: `task.max_turns`, the trajectory budget
            (prompt included), `task.env_timeout_s`.
    """

    def __init__(self, env_cls: type, spec: str, *, decode: Callable[[list[int]], str],
                 encode: Callable[[Any], list[int]], max_turns: int, max_total_tokens: int, timeout_s: float) -> None:
        self.env_cls, self.spec = env_cls, spec
        self.decode, self.encode = decode, encode
        self.max_turns, self.max_total_tokens, self.timeout_s = int(max_turns), int(max_total_tokens), float(timeout_s)
        self.live: dict[SampleId, Trajectory] = {}
        self.ready: list[GenRequest] = []  # model turns to add to the engine
        self.done: list[GenResult] = []  # finished trajectories not yet handed out

    # ------------------------------------------------------------------ starting

    def start(self, r: GenRequest, version: int) -> None:
        """Take trajectory `r` (fresh, or moved here with its history): reset its environment,
        replaying its finished turns, on a thread."""
        sid = tuple(r.sample_id)
        n = len(r.prefix_ids)
        mask = list(r.prefix_mask) or [1] * n
        turns = [tuple(t) for t in r.prefix_turns]
        last_obs = max((i + 1 for i, m in enumerate(mask) if m == 0), default=0)
        t = Trajectory(request=r, ids=list(r.prefix_ids), mask=mask, logprobs=list(r.prefix_logprobs) or [0.0] * n,
                       turns=turns, turn_start=max(last_obs, turns[-1][1] if turns else 0), version=int(version))
        actions = [self.decode(t.ids[a:b]) for a, b in turns]
        fresh = n == 0

        def reset() -> tuple[Any, Any, float]:
            env = self.env_cls()
            obs = run_call(env.reset, dict(r.env_sample or {}))
            check_observation(obs)
            reward = 0.0
            for i, action in enumerate(actions):  # replay: the same actions rebuild the same state
                _, rew, done = check_step(run_call(env.step, action))
                reward += rew
                if done:
                    raise EnvFailure(f"ended at replayed turn {i + 1} of {len(actions)} (an environment must be a "
                                     "function of its sample and actions)")
            return env, obs if fresh else None, reward

        self.live[sid] = t
        self._call(t, "reset", reset)

    def _call(self, t: Trajectory, kind: str, fn: Callable[[], Any]) -> None:
        t.call, t.call_kind, t.deadline = in_thread(fn), kind, time.perf_counter() + self.timeout_s

    # ------------------------------------------------------------------ engine side

    def owns(self, sid: SampleId) -> bool:
        return tuple(sid) in self.live

    def turn_done(self, res: GenResult) -> None:
        """A model turn ended: its tokens join the trajectory, the environment steps on them."""
        t = self.live[tuple(res.sample_id)]
        t.in_engine = False
        t.ids += list(res.response_ids)
        t.logprobs += list(res.logprobs)
        t.mask += [1] * len(res.response_ids)
        t.turns.append((t.turn_start, len(t.ids)))
        action = self.decode(t.ids[t.turn_start:])
        self._call(t, "step", lambda: check_step(run_call(t.env.step, action)))

    def take_ready(self) -> list[GenRequest]:
        out, self.ready = self.ready, []
        return out

    def take_done(self) -> list[GenResult]:
        out, self.done = self.done, []
        return out

    def pending(self) -> list[cf.Future]:
        return [t.call for t in self.live.values() if t.call is not None]

    def wait(self, max_s: float) -> None:
        """Until an environment call ends or is past its deadline, at most `max_s`."""
        calls = [t for t in self.live.values() if t.call is not None]
        if calls:
            soonest = min(t.deadline for t in calls) - time.perf_counter()
            cf.wait([t.call for t in calls], timeout=max(0.0, min(max_s, soonest)), return_when=cf.FIRST_COMPLETED)

    def poll(self) -> None:
        """Environment calls that ended (or ran out of time): next turns to `ready`, finished
        trajectories to `done`."""
        now = time.perf_counter()
        for t in list(self.live.values()):
            if t.call is None or not (t.call.done() or now >= t.deadline):
                continue
            call, kind, t.call = t.call, t.call_kind, None
            if not call.done():
                self._finish(t, "env_error", f"environment {self.spec} {kind} timed out after {self.timeout_s:g} s")
                continue
            try:
                out = call.result()
            except BaseException as exc:
                self._finish(t, "env_error", failure(self.spec, kind, exc))
                continue
            if kind == "reset":
                t.env, obs, t.reward = out
                self._observe(t, obs, new_turn=not t.request.prefix_ids)
            else:
                obs, reward, done = out
                t.reward += reward
                if done:
                    self._finish(t, "done")
                elif len(t.turns) >= self.max_turns:
                    self._finish(t, "max_turns")
                else:
                    self._observe(t, obs, new_turn=True)

    def _observe(self, t: Trajectory, obs: Any, new_turn: bool) -> None:
        """Append an observation's tokens (cut at the budget) and queue the next model turn (a
        new one, or the one it brought partly made)."""
        tokens = self.encode(obs) if obs is not None else []
        tokens = tokens[:max(0, self._room(t))]
        t.ids += tokens
        t.mask += [0] * len(tokens)
        t.logprobs += [0.0] * len(tokens)
        if new_turn:
            t.turn_start = len(t.ids)
        made = len(t.ids) - t.turn_start
        left = min(int(t.request.max_new_tokens) - made, self._room(t))
        if left <= 0:
            self._finish(t, "max_total_tokens")
            return
        r = t.request
        self.ready.append(GenRequest(sample_id=r.sample_id, prompt_ids=[*r.prompt_ids, *t.ids], max_new_tokens=left,
                                     seed=turn_seed(r.seed, len(t.turns)) + RESUME_SEED_STRIDE * made))
        t.in_engine = True

    def _room(self, t: Trajectory) -> int:
        return self.max_total_tokens - len(t.request.prompt_ids) - len(t.ids)

    def _finish(self, t: Trajectory, reason: str, error: str | None = None) -> None:
        t.stop_reason, t.error = reason, error
        del self.live[tuple(t.request.sample_id)]
        self.done.append(self.result(t))

    def result(self, t: Trajectory) -> GenResult:
        return GenResult(sample_id=tuple(t.request.sample_id), response_ids=list(t.ids), logprobs=list(t.logprobs),
                         version=t.version, duration_s=time.perf_counter() - t.t0, loss_mask=tuple(t.mask),
                         turns=len(t.turns), env_reward=t.reward, stop_reason=t.stop_reason, env_error=t.error)

    # ------------------------------------------------------------------ moving and stopping

    def progress(self, sid: SampleId, turn: tuple[list[int], list[float]] | None) -> tuple[list[int], list[float]]:
        """The trajectory's tokens beyond the prefix it came with (and the running turn's
        tokens so far, `turn`) and their log-probs."""
        t = self.live[tuple(sid)]
        n = len(t.request.prefix_ids)
        toks, lps = turn if (turn is not None and t.in_engine) else ([], [])
        return t.ids[n:] + list(toks), t.logprobs[n:] + list(lps)

    def moved(self, sid: SampleId, turn: tuple[list[int], list[float]] | None, keep: bool) -> GenRequest:
        """The request that continues trajectory `sid` elsewhere: its history in the prefix
        (with `keep`, the running turn's tokens too; else that turn starts again)."""
        t = self.live[tuple(sid)]
        ids, lps, mask, turns = list(t.ids), list(t.logprobs), list(t.mask), list(t.turns)
        if t.call is not None and t.call_kind == "step":  # its last turn's step not applied: that turn runs again
            cut, turns = turns[-1][0], turns[:-1]
        elif keep and turn is not None and t.in_engine:
            cut = len(ids)
            ids, lps, mask = ids + list(turn[0]), lps + list(turn[1]), mask + [1] * len(turn[0])
        else:
            cut = len(ids) if keep else t.turn_start  # without keep a turn starts again from its first token
        if cut < len(t.ids):
            ids, lps, mask = ids[:cut], lps[:cut], mask[:cut]
        return replace(t.request, prefix_ids=tuple(ids), prefix_logprobs=tuple(lps), prefix_mask=tuple(mask),
                       prefix_turns=tuple(turns))

    def drop(self, ids: Sequence[SampleId]) -> list[SampleId]:
        """Forget these trajectories (their environment calls are abandoned); those it had."""
        out = [tuple(s) for s in ids if tuple(s) in self.live]
        for s in out:
            del self.live[s]
        self.ready = [r for r in self.ready if tuple(r.sample_id) not in set(out)]
        return out

    def clear(self) -> None:
        self.live, self.ready, self.done = {}, [], []


class TurnEngine:
    """A `SteppingEngine` over `engine` whose requests with `env_sample` are trajectories run by
    `loop` (see the module docstring); results come back in the order they end."""

    def __init__(self, engine: Any, loop: TurnLoop) -> None:
        self.engine, self.loop = engine, loop

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def add(self, requests: Sequence[GenRequest]) -> None:
        self.engine.add([r for r in requests if r.env_sample is None])
        for r in requests:
            if r.env_sample is not None:
                self.loop.start(r, self.version)

    def step(self) -> list[GenResult]:
        out: list[GenResult] = []
        if self.engine.has_unfinished():
            for res in self.engine.step():
                if self.loop.owns(res.sample_id):
                    self.loop.turn_done(res)
                else:
                    out.append(res)
        else:
            self.loop.wait(ENV_POLL_S)
        self.loop.poll()
        self.engine.add(self.loop.take_ready())
        return out + self.loop.take_done()

    def abort(self, sample_ids: Sequence[SampleId]) -> list[SampleId]:
        stopped = self.engine.abort(sample_ids)
        dropped = self.loop.drop(sample_ids)
        return list(dict.fromkeys([*map(tuple, stopped), *dropped]))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self.loop.live) or bool(self.loop.done)

    def progress(self) -> dict[SampleId, tuple[list[int], list[float]]]:
        made = self.engine.progress()
        for sid in self.loop.live:
            made[sid] = self.loop.progress(sid, made.get(sid))
        return made

    def moved(self, sid: SampleId, keep: bool) -> GenRequest:
        return self.loop.moved(sid, self.engine.progress().get(tuple(sid)), keep)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        from dynaresize.roles.base import run_to_completion

        return run_to_completion(self, requests)
