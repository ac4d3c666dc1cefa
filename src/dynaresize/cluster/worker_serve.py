"""A rollout worker serving requests one engine iteration at a time (the streaming router's
side on the device, cluster/router.py).

`serve(add, max_s)` is one call on the worker's main thread: it starts the requests given,
then runs engine iterations (`SteppingEngine.step`) until a request finishes, `max_s` has
passed, or nothing runs; it returns the finished results and
how many requests still run. The driver keeps at most one `serve` in flight per engine and
sends the next one when it comes back, so between any two iterations the worker serves its
other calls (a weight pull, a release, the ops of a resize) in the order the driver sent them:
the one-issuing-thread rule of cluster/worker.py holds unchanged.

Weight versions per token. A request is tagged with the version its engine held when it
started. A pull while requests run happens only under partial rollout (`rollout.partial`;
otherwise it is a bug and refused): each running request then notes (new version, tokens made
so far), and its result carries the list (`GenResult.versions`), so the ledger sees the oldest
version and the trainer the per-token log-probs of the weights that made each token.

Moving requests (`abort_all`, the `migrate_requests` op): every running request stops and
comes back as a request to send elsewhere. With `keep` (partial rollout) it carries its
prefix (tokens, log-probs, versions) and continues from prompt + prefix on another replica,
a fresh prefill there (the KV does not move); otherwise it comes back as it was sent and runs
again from its first token, which gives the same tokens (the seed belongs to the sample).

Multi-turn (`GenRequest.env_sample`, roles/multiturn.py): the worker's turn loop runs around
the engine (`_stepper`, a `TurnEngine`), in `serve` and in `generate` alike; a trajectory counts
as running while a model turn decodes or an environment call is pending, and `serve` waits for
environment calls within its `max_s` when nothing decodes. Its result holds the whole
trajectory (nothing is put in front of it here); a moved trajectory carries its history
(tokens, log-probs, loss mask, finished turns) and, with `keep`, its running turn's tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

from dynaresize.roles.base import GenRequest, GenResult, SampleId
from dynaresize.roles.multiturn import RESUME_SEED_STRIDE, TurnEngine, TurnLoop  # noqa: F401 (a resumed request's stream)


LOCKSTEP_ITERATIONS = 8  # a TP replica's slice: engine iterations per `serve` call on every rank


@dataclass
class _Serving:
    request: GenRequest  # as the driver sent it (prefix included)
    versions: list[tuple[int, int]]  # (version, first token index), ascending


def engine_request(r: GenRequest) -> GenRequest:
    """What the engine runs for `r`: with a prefix, prompt + prefix and the rest of its length
    (a trajectory as it is: the turn loop continues it)."""
    if not r.prefix_ids or r.env_sample is not None:
        return r
    n = len(r.prefix_ids)
    return GenRequest(sample_id=r.sample_id, prompt_ids=[*r.prompt_ids, *r.prefix_ids],
                      max_new_tokens=max(0, r.max_new_tokens - n), seed=int(r.seed) + RESUME_SEED_STRIDE * n,
                      forced_length=None if r.forced_length is None else max(0, r.forced_length - n))


def whole_result(r: GenRequest, res: GenResult, versions: list[tuple[int, int]]) -> GenResult:
    """The engine's result of `engine_request(r)` with `r`'s prefix in front, its version the
    oldest of its tokens and `versions` kept only when more than one made them. A trajectory's
    result is whole already (its prefix is in it)."""
    whole = r.env_sample is not None
    n = len(res.response_ids) + (0 if whole else len(r.prefix_ids))  # a pull after its last token made none
    marks = _normal([(v, i) for v, i in versions if i < n] or versions[:1])
    kept = {"version": min(v for v, _ in marks), "versions": tuple(marks) if len(marks) > 1 else ()}
    if whole:
        return replace(res, **kept)
    return replace(res, response_ids=[*r.prefix_ids, *res.response_ids],
                   logprobs=[*r.prefix_logprobs, *res.logprobs], **kept)


def _normal(versions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop marks that change nothing (same version again, or superseded at the same index)."""
    out: list[tuple[int, int]] = []
    for v, i in versions:
        if out and out[-1][1] == i:
            out.pop()
        if not out or out[-1][0] != v:
            out.append((v, i))
    return out


class ServeMixin:
    """`DeviceWorker` methods for request-level rollout (attributes: `engine`, `cfg`, `device`)."""

    def _tp_size(self) -> int:
        """Devices of this device's rollout replica (`DeviceWorker.set_replica`; 1 without)."""
        replica = getattr(self, "_replica", None)
        return 1 if replica is None else len(replica[0])

    def _stepper(self):
        """The engine as the worker drives it: with a multi-turn task, inside its turn loop."""
        loop = self._turn_loop()
        return self.engine if loop is None else TurnEngine(self.engine, loop)

    def _turn_loop(self) -> TurnLoop | None:
        """This worker's turn loop (roles/multiturn.py), made on first use; None for a
        single-turn task."""
        if getattr(self, "_turns", None) is None:
            from dynaresize.rl.env import env_spec

            task = getattr(self.cfg, "task", None)  # (test stand-ins of the worker carry no task)
            spec = None if task is None else env_spec(task)
            self._turns = False if spec is None else make_turn_loop(self.cfg, spec)
        return self._turns or None

    def _served(self) -> dict[SampleId, _Serving]:
        if getattr(self, "_serving", None) is None:
            self._serving = {}
        return self._serving

    def serve(self, add: Sequence[GenRequest] = (), max_s: float = 0.2, *, abort_all: bool = False,
              keep: bool = False) -> dict:
        """See the module docstring. Returns results (finished), moved (requests to send
        elsewhere, with `abort_all`), running (how many still run), t0, t1, device."""
        for s in sorted({int(r.sample_id[0]) for r in add}):
            self._maybe_fault("rollout", s)
        self._pin_threads()
        t0 = time.time()
        serving = self._served()
        stepper = self._stepper()
        moved = self._stop(list(serving), keep) if abort_all else []
        if add:
            version = int(self.engine.version)
            for r in add:
                start = list(r.prefix_versions) or [(version, 0)]
                serving[tuple(r.sample_id)] = _Serving(request=r, versions=[*start, (version, len(r.prefix_ids))])
            stepper.add([engine_request(r) for r in add])
        results: list[GenResult] = []
        deadline = t0 + max(0.0, float(max_s))
        # A TP replica's ranks run in lockstep: each must run the same iterations between the
        # same calls, so the slice is counted in iterations there, not read off its own clock.
        lockstep = self._tp_size() > 1
        iterations = 0
        while stepper.has_unfinished() and not abort_all:
            for res in stepper.step():
                s = serving.pop(tuple(res.sample_id))
                results.append(whole_result(s.request, res, s.versions))
            iterations += 1
            if results or (iterations >= LOCKSTEP_ITERATIONS if lockstep else time.time() >= deadline):
                break
        return {"results": results, "moved": moved, "running": len(serving), "t0": t0, "t1": time.time(),
                "device": self.device}

    def _stop(self, ids: list[SampleId], keep: bool) -> list[GenRequest]:
        """Abort `ids`; the requests to send again (with their prefix when `keep`)."""
        if not ids:
            return []
        serving = self._served()
        stepper = self._stepper()
        made = stepper.progress() if keep else {}
        histories = {tuple(sid): stepper.moved(sid, keep) for sid in ids
                     if isinstance(stepper, TurnEngine) and stepper.loop.owns(sid)}
        stopped = stepper.abort(ids)
        out = []
        for sid in stopped:
            s = serving.pop(tuple(sid))
            r = s.request
            if tuple(sid) in histories:  # a trajectory: its history, versions up to where it was cut
                r = histories[tuple(sid)]
                r = replace(r, prefix_versions=tuple(_normal([m for m in s.versions if m[1] < max(1, len(r.prefix_ids))])))
            elif keep:
                tokens, logprobs = made.get(tuple(sid), ([], []))
                r = replace(r, prefix_ids=(*r.prefix_ids, *tokens), prefix_logprobs=(*r.prefix_logprobs, *logprobs),
                            prefix_versions=tuple(_normal(s.versions)))
            out.append(r)
        return out

    def _mark_version(self, version: int) -> None:
        """The engine now holds `version`: each running request notes where its tokens switch."""
        serving = self._served()
        if not serving:
            return
        if not self.cfg.rollout.partial:
            raise RuntimeError(f"device {self.device}: weights changed to version {version} under "
                               f"{len(serving)} running requests without rollout.partial")
        made = self._stepper().progress()
        for sid, s in serving.items():
            s.versions.append((int(version), len(s.request.prefix_ids) + len(made.get(sid, ([], []))[0])))

    def _forget_requests(self) -> int:
        """The engine is released: its running requests go with it. How many there were."""
        n = len(self._served())
        self._serving = {}
        if getattr(self, "_turns", None):
            self._turns.clear()
        return n


def make_turn_loop(cfg, spec: str) -> TurnLoop:
    """The turn loop of run config `cfg` in environment `spec`: the model's tokenizer decodes
    actions and encodes observations (chat messages through its chat template, or the built-in
    one for the built-in tokenizer: rl/tasks.py)."""
    from dynaresize.rl.env import load_env
    from dynaresize.rl.models import load_tokenizer, max_positions
    from dynaresize.rl.tasks import TINY_CHAT_TEMPLATE, decode_response

    tok = load_tokenizer(cfg.model)
    template = None if getattr(tok, "chat_template", None) else TINY_CHAT_TEMPLATE
    base = [{"role": "user", "content": "x"}]
    head = tok.apply_chat_template(base, tokenize=False, chat_template=template)

    def encode(obs) -> list[int]:
        if isinstance(obs, str):
            text = obs
        else:  # messages: what the template adds after a conversation, up to the model's next turn
            whole = tok.apply_chat_template(base + list(obs), tokenize=False, add_generation_prompt=True,
                                            chat_template=template)
            text = whole[len(head):] if whole.startswith(head) else whole
        return list(tok(text, add_special_tokens=False)["input_ids"])

    t = cfg.task
    return TurnLoop(load_env(spec), spec, decode=lambda ids: decode_response(tok, ids), encode=encode,
                    max_turns=t.max_turns, max_total_tokens=t.max_total_tokens or max_positions(cfg.model),
                    timeout_s=t.env_timeout_s)
