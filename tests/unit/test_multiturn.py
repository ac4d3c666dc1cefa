"""Multi-turn rollouts over the real HF engine (roles/multiturn.py): a trajectory is exactly the
engine's tokens plus the observations' tokens (never re-tokenized), its loss mask covers the
model's tokens only, per-turn seeds make it independent of its batch and of where it runs, a
trajectory moved mid-way (with or without its running turn) continues to the same or a
consistent result, limits and environment failures end it with their reason, and the serve
layer hands a moved trajectory on with its history."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dynaresize.cluster.worker_serve import ServeMixin
from dynaresize.config import ModelConfig
from dynaresize.rl.models import build_model, load_tokenizer
from dynaresize.rl.seeds import sample_seed
from dynaresize.rl.tasks import decode_response
from dynaresize.roles.base import GenRequest
from dynaresize.roles.multiturn import TurnEngine, TurnLoop, turn_seed
from dynaresize.roles.rollout_hf import HFRolloutEngine

CFG = ModelConfig()
TOK = load_tokenizer(CFG)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SEEN: list[tuple[str, str]] = []  # (action, observation) every EchoEnv step saw and gave


class EchoEnv:
    """Three turns; each observation depends on the action (so a moved trajectory's replay must
    give the same state); the reward is the number of actions with an 'a' in them."""

    def reset(self, sample):
        self.n, self.tag = 0, sample["tag"]
        return f" {self.tag} begin :"

    def step(self, action):
        self.n += 1
        obs = f" {self.tag} turn {self.n} saw {len(action)} :"
        SEEN.append((action, obs))
        return obs, float("a" in action), self.n >= 3


class ChatEnv(EchoEnv):
    def step(self, action):
        obs, reward, done = super().step(action)
        return [{"role": "tool", "content": obs}], reward, done


def _encode(obs) -> list[int]:
    if isinstance(obs, str):
        return list(TOK(obs, add_special_tokens=False)["input_ids"])
    from dynaresize.rl.tasks import TINY_CHAT_TEMPLATE

    base = [{"role": "user", "content": "x"}]
    head = TOK.apply_chat_template(base, tokenize=False, chat_template=TINY_CHAT_TEMPLATE)
    whole = TOK.apply_chat_template(base + obs, tokenize=False, add_generation_prompt=True,
                                    chat_template=TINY_CHAT_TEMPLATE)
    return list(TOK(whole[len(head):], add_special_tokens=False)["input_ids"])


def _loop(env_cls=EchoEnv, max_turns=4, max_total=400, timeout_s=30.0) -> TurnLoop:
    return TurnLoop(env_cls, "test:Env", decode=lambda ids: decode_response(TOK, ids), encode=_encode,
                    max_turns=max_turns, max_total_tokens=max_total, timeout_s=timeout_s)


class Recording:
    """The HF engine, recording every request it is given and every result it returns."""

    def __init__(self, weights) -> None:
        self.engine = HFRolloutEngine(CFG, temperature=1.0)
        self.engine.set_weights(weights, 0)
        self.added, self.results = [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, requests):
        self.added += list(requests)
        self.engine.add(requests)

    def step(self):
        out = self.engine.step()
        self.results += out
        return out


@pytest.fixture(scope="module")
def weights():
    model = build_model(CFG)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _req(p: int, tag: str = "bako", n: int = 12) -> GenRequest:
    return GenRequest(sample_id=(2, p, 0), prompt_ids=[2, 10 + p, 11, 12], max_new_tokens=n,
                      seed=sample_seed(5, 2, p, 0), env_sample={"prompt": "x", "tag": tag})


def _run(weights, reqs, env_cls=EchoEnv, **kw):
    eng = Recording(weights)
    te = TurnEngine(eng, _loop(env_cls, **kw))
    return {r.sample_id: r for r in te.generate(reqs)}, eng


@pytest.mark.parametrize("env_cls", [EchoEnv, ChatEnv])
def test_trajectory_is_the_engines_tokens_plus_the_observations_with_the_model_tokens_masked(weights, env_cls):
    SEEN.clear()
    req = _req(0)
    out, eng = _run(weights, [req], env_cls)
    res = out[req.sample_id]
    assert res.turns == 3 and res.stop_reason == "done" and res.env_error is None
    turns = [r for r in eng.results if r.sample_id == req.sample_id]
    assert len(turns) == 3 and len(SEEN) == 3
    reset_obs = _encode(f" bako begin :")
    want, mask, lps = list(reset_obs), [0] * len(reset_obs), [0.0] * len(reset_obs)
    for i, turn in enumerate(turns):
        # the engine saw exactly the trajectory so far after the prompt
        assert eng.added[i].prompt_ids == [*req.prompt_ids, *want]
        assert eng.added[i].seed == turn_seed(req.seed, i)
        assert SEEN[i][0] == decode_response(TOK, turn.response_ids)
        want += turn.response_ids
        mask += [1] * len(turn.response_ids)
        lps += turn.logprobs
        if i < 2:  # no observation after the last turn
            obs = _encode(SEEN[i][1] if env_cls is EchoEnv else [{"role": "tool", "content": SEEN[i][1]}])
            want += obs
            mask += [0] * len(obs)
            lps += [0.0] * len(obs)
    assert res.response_ids == want and list(res.loss_mask) == mask and res.logprobs == lps
    assert res.env_reward == sum(float("a" in a) for a, _ in SEEN)
    model_tokens = [t for t, m in zip(res.response_ids, res.loss_mask) if m]
    assert model_tokens == [t for turn in turns for t in turn.response_ids]


def test_retokenizing_the_models_text_would_change_its_tokens(weights):
    """Why the loop keeps token ids: the tiny model's sampled bytes do not survive decode + encode."""
    out, eng = _run(weights, [_req(p) for p in range(4)])
    changed = [r for r in eng.results
               if list(TOK(TOK.decode(r.response_ids), add_special_tokens=False)["input_ids"]) != r.response_ids]
    assert changed  # and yet every trajectory holds the engine's own ids (previous test)


def test_a_trajectory_is_the_same_alone_in_a_batch_and_on_another_engine(weights):
    reqs = [_req(p, tag=t) for p, t in enumerate(["bako", "kedo", "haho"])]
    together, _ = _run(weights, reqs)
    for r in reqs:
        alone, _ = _run(weights, [r])
        assert alone[r.sample_id].response_ids == together[r.sample_id].response_ids
        assert alone[r.sample_id].loss_mask == together[r.sample_id].loss_mask


def _step_until(te: TurnEngine, sid, cond) -> None:
    for _ in range(10_000):
        if cond(te.loop.live[sid]):
            return
        te.step()
    raise AssertionError("condition never met")


class Gated(EchoEnv):
    """Its second step waits for `gate` (so a move finds that environment call pending)."""

    gate = threading.Event()

    def step(self, action):
        if self.n == 1:
            self.gate.wait(60)
        return super().step(action)


@pytest.mark.parametrize("where", ["mid-turn", "env-pending"])
def test_a_trajectory_moved_without_its_running_turn_ends_the_same(weights, where):
    req = _req(1)
    ref, _ = _run(weights, [req])
    Gated.gate.clear()
    te = TurnEngine(Recording(weights), _loop(Gated))
    te.add([req])
    if where == "mid-turn":
        cond = lambda t: len(t.turns) == 1 and t.in_engine and te.engine.progress().get(req.sample_id, ([],))[0]
    else:
        cond = lambda t: len(t.turns) == 2 and t.call is not None
    _step_until(te, req.sample_id, cond)
    moved = te.moved(req.sample_id, keep=False)
    Gated.gate.set()
    assert te.abort([req.sample_id]) == [req.sample_id] and not te.has_unfinished()
    assert len(moved.prefix_turns) == 1 and len(moved.prefix_mask) == len(moved.prefix_ids) > 0
    again, eng2 = _run(weights, [moved])
    got = again[req.sample_id]
    assert got.response_ids == ref[req.sample_id].response_ids and got.loss_mask == ref[req.sample_id].loss_mask
    assert got.turns == 3 and got.env_reward == ref[req.sample_id].env_reward
    assert len([r for r in eng2.results if r.sample_id == req.sample_id]) == 2  # only the turns not yet done


def test_a_trajectory_moved_with_its_running_turn_keeps_its_prefix(weights):
    req = _req(2)
    te = TurnEngine(Recording(weights), _loop())
    te.add([req])
    _step_until(te, req.sample_id, lambda t: len(t.turns) == 1 and t.in_engine
                and len(te.engine.progress().get(req.sample_id, ([],))[0]) >= 3)
    made = te.progress()[req.sample_id][0]
    moved = te.moved(req.sample_id, keep=True)
    assert list(moved.prefix_ids) == made and moved.prefix_mask[-3:] == (1, 1, 1)
    te.abort([req.sample_id])
    got = _run(weights, [moved])[0][req.sample_id]
    assert got.response_ids[:len(made)] == made and got.turns == 3
    assert len(got.loss_mask) == len(got.response_ids) == len(got.logprobs)
    assert list(got.loss_mask[:len(made)]) == list(moved.prefix_mask)


def test_limits_end_a_trajectory_with_their_reason(weights):
    out, _ = _run(weights, [_req(0)], max_turns=2)
    assert (out[(2, 0, 0)].turns, out[(2, 0, 0)].stop_reason) == (2, "max_turns")
    out, _ = _run(weights, [_req(0)], max_total=4 + 30)
    res = out[(2, 0, 0)]
    assert res.stop_reason == "max_total_tokens" and 4 + len(res.response_ids) == 34


class Broken(EchoEnv):
    def step(self, action):
        raise KeyError("no such thing")


class Hangs(EchoEnv):
    gate = threading.Event()  # never set: step waits until its deadline is long past

    def step(self, action):
        self.gate.wait(60)
        return None, 0.0, True


class BadReturn(EchoEnv):
    def step(self, action):
        return "obs", "1.0", False


@pytest.mark.parametrize("env_cls,fragment", [(Broken, "step raised KeyError: 'no such thing'"),
                                              (Hangs, "step timed out after 0.3 s"),
                                              (BadReturn, "reward '1.0', not a finite number")])
def test_an_environment_that_fails_ends_its_trajectory_with_the_reason(weights, env_cls, fragment):
    out, _ = _run(weights, [_req(0), replace(_req(1), env_sample=None)], env_cls, timeout_s=0.3)
    res = out[(2, 0, 0)]
    assert res.stop_reason == "env_error" and fragment in res.env_error and "test:Env" in res.env_error
    assert res.turns == 1 and res.env_reward == 0.0
    assert out[(2, 1, 0)].turns == 0 and out[(2, 1, 0)].response_ids  # a single-turn request beside it


class Server(ServeMixin):
    def __init__(self, weights) -> None:
        self.engine = HFRolloutEngine(CFG, temperature=1.0)
        self.engine.set_weights(weights, 0)
        self.cfg = SimpleNamespace(rollout=SimpleNamespace(partial=False))
        self.device = 0
        self._turns = _loop()

    def _maybe_fault(self, point, step):
        pass

    def _pin_threads(self):
        pass


def test_serve_hands_a_moved_trajectory_on_with_its_history(weights):
    req = _req(3)
    ref, _ = _run(weights, [req])
    a = Server(weights)
    a.serve([req], 0.0)
    while not a._turns.live[req.sample_id].turns:
        assert a.serve((), 0.01)["running"] == 1
    moved = a.serve((), 0.0, abort_all=True)["moved"]
    assert len(moved) == 1 and moved[0].prefix_turns and a.serve((), 0.0)["running"] == 0
    b = Server(weights)
    b.serve(moved, 0.0)
    results = []
    while not results:
        results = b.serve((), 0.05)["results"]
    got = results[0]
    assert got.response_ids == ref[req.sample_id].response_ids and got.loss_mask == ref[req.sample_id].loss_mask
    assert got.version == 0 and got.versions == ()
