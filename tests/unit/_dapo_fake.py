"""A stand-in for `driver.run.Run` around `driver.dynamic_sampling.DynamicSampling`: the real
`Job` (prompts, requests, reward pool, advantages), the real `Ledger`, and a rollout that answers
each request with a fixed text chosen by its prompt index (no engine, no Ray).

Texts for the toy task (reward: the share of words starting with "b"), by prompt index p % 4:
0: every sample " bako bemi" (reward 1: a constant group), 1: samples alternate " bako" and
" the word" (1 and 0: signal), 2: all b-words of different lengths (reward 1, lengths differ:
constant score, varied shaped reward), 3: every sample " the" (reward 0: constant).
"""

from __future__ import annotations

from typing import Any

from dynaresize.config import RunConfig
from dynaresize.driver.job import Job
from dynaresize.driver.ledger import Ledger
from dynaresize.pipeline.stepstate import StepRollout
from dynaresize.roles.base import GenResult

TEXTS = {0: [" bako bemi"], 1: [" bako", " the word"], 2: [" bako", " bako bemi bute bado"], 3: [" the"]}


def text_for(sample_id: tuple[int, int, int]) -> str:
    options = TEXTS[sample_id[1] % 4]
    return options[sample_id[2] % len(options)]


class FakeRun:
    """What DynamicSampling reads of a Run: cfg, job, ledger, rec, _rollout, _expect."""

    def __init__(self, cfg: RunConfig, job: Job | None = None) -> None:
        self.cfg = cfg
        self.job = job or Job(cfg)
        self.ledger = Ledger(staleness=cfg.train.staleness)
        self.rollouts: dict[int, StepRollout] = {}
        self.records: list[dict] = []
        self.rec = self
        self.sent: list[list[tuple[int, int, int]]] = []  # the sample ids of each rollout call
        self.dyn = None

    def emit(self, kind: str, **fields: Any) -> dict:
        self.records.append({"kind": kind, **fields})
        return fields

    def _expect(self, step: int) -> None:
        self.ledger.expect(step, self.job.expected_ids(step, self.dyn.batches(step) if self.dyn else 1))

    def _rollout(self, step: int) -> StepRollout:
        if step not in self.rollouts:
            self.rollouts[step] = StepRollout(step=step, remaining=self.job.requests(step))
        buf = self.rollouts[step]
        if buf.remaining:
            self.sent.append([r.sample_id for g in buf.remaining for r in g])
            tok = self.job.tokenizer
            for g in buf.remaining:
                for r in g:
                    ids = list(tok(text_for(r.sample_id))["input_ids"])
                    buf.results.append((0, GenResult(sample_id=r.sample_id, response_ids=ids,
                                                     logprobs=[-1.0] * len(ids), version=0, duration_s=0.0)))
            buf.remaining = []
        return buf


def scored_with_filter(cfg: RunConfig, step: int = 0) -> tuple:
    """Step `step` scored through DynamicSampling on the fake run (filtering on), or through
    `Job.score` as the run does with filtering off: (consumed ids, advantages, drops, fields),
    or the error it stops with."""
    from dynaresize.driver.dynamic_sampling import DynamicSampling
    from dynaresize.errors import DynaresizeError

    run = FakeRun(cfg)
    try:
        if cfg.algorithm.filter_groups:
            run.dyn = DynamicSampling(run)
            run._expect(step)
            scored = run.dyn.scored(step)
        else:
            run._expect(step)
            scored = run.job.score(step, run._rollout(step).results, run.ledger)
    except DynaresizeError as exc:
        return type(exc).__name__, str(exc)
    finally:
        run.job.close()
    drops = sorted((sid, e.dropped) for sid, e in run.ledger.entries.items() if e.dropped)
    return ([s.sample_id for s in scored.samples], [round(s.advantage, 9) for s in scored.samples], drops,
            scored.filtering)
