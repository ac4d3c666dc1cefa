"""Evaluation on held-out prompts, on the rollout pool, outside the ledger.

`Evaluator.due(step)` says whether the run evaluates after step `step`: after every
`eval.every_steps`-th step and after the last one. `Evaluator.run(...)` then sends the eval
requests to the rollout devices of the current assignment (the same engines, holding the
weights just synced: version step+1), scores them with the task's reward (in the job's reward
pool, with its deadline and in the reward's own style, as training samples are) and emits one
`eval` record (docs/records.md) with mean reward and pass@k. `eval.prompts_file` is read as
`task.dataset` is: parquet or JSONL, verl's or TRL's schema, `task.columns` applied.

Invariants:
- eval samples are not training samples: their ids are `(EVAL_STEP, prompt, sample)` with
  `EVAL_STEP = -1`, they are never shown to the ledger (neither expected nor generated), and no
  injected fault fires for them (fault points have steps >= 0);
- evaluation runs between windows, when the pipeline is drained (the rollout of the next step
  has not started), so it changes no step's timings, no sample's tokens and no trainer state:
  a run with evaluation trains exactly as the same run without (deterministic mode, tested);
- a sample's seed is `derived_seed(run_seed, "eval", prompt, sample)`: the same at every
  evaluation, so successive evaluations differ only by the weights (common random numbers);
- held-out prompts are never training prompts: `eval.prompts_file`, or the built-in task's
  test split (`rl.tasks.toy_held_out_prompts`, disjoint from its training prompts by text).

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
Trained on Code"): from n samples of a prompt of which c are correct (reward >=
`eval.correct_threshold`), pass@k = 1 - C(n-c, k) / C(n, k), averaged over prompts; k = 1
is the mean fraction correct, k = n whether any sample is correct.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from dynaresize.config import RunConfig
from dynaresize.errors import DataError, RewardError, UserError
from dynaresize.rl import dataset, tasks
from dynaresize.rl.seeds import derived_seed
from dynaresize.roles.base import GenRequest
from dynaresize.types import ROLLOUT

EVAL_STEP = -1  # the step of every eval sample id: no training step and no fault point has it


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a product: no big integers
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k an evaluation reports with n samples per prompt: 1, 2, 4, ... and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def held_out_prompts(cfg: RunConfig) -> list[dict]:
    """The prompt records an evaluation uses (see the module docstring)."""
    ec = cfg.eval
    if ec.prompts_file is not None:  # parquet or JSONL, verl's or TRL's schema, as task.dataset
        records = dataset.load_dataset(ec.prompts_file, cfg.task.columns)
        return records[:ec.num_prompts] if ec.num_prompts else records
    name = cfg.task.name
    if cfg.task.prompts_file is None and (name == tasks.TOY_TASK or name.startswith(tasks.TOY_TASK + ":")):
        try:
            return tasks.toy_held_out_prompts(ec.num_prompts, letters=name.partition(":")[2] or tasks.TOY_LETTERS)
        except ValueError as exc:
            raise UserError(f"eval.num_prompts={ec.num_prompts}: {exc}") from None
    raise UserError("eval.prompts_file: this task has no built-in held-out prompts; name a prompt file")


class Evaluator:
    """Held-out prompts, their requests and the `eval` records of one run."""

    def __init__(self, cfg: RunConfig, job: Any) -> None:
        self.cfg = cfg
        self.job = job
        self.enabled = cfg.eval.every_steps > 0
        self.prompts: list[dict] = held_out_prompts(cfg) if self.enabled else []
        self.last: dict | None = None  # the metrics of the latest evaluation (for the summary)
        if self.enabled:
            train = {dataset.prompt_key(r["prompt"]) for r in job.prompts}
            shared = sum(1 for r in self.prompts if dataset.prompt_key(r["prompt"]) in train)
            if shared:
                print(f"dynaresize: warning: {shared} of the {len(self.prompts)} eval prompts are also training "
                      "prompts (eval.prompts_file overlaps the task's prompts)", file=sys.stderr)
            self._groups = self._requests()  # encodes every prompt now: a prompt too long fails before step 0

    def due(self, step: int) -> bool:
        """Whether the run evaluates after training step `step` (0-based)."""
        every = self.cfg.eval.every_steps
        return self.enabled and ((step + 1) % every == 0 or step == self.cfg.steps - 1)

    def _requests(self) -> list[list[GenRequest]]:
        ec, rc = self.cfg.eval, self.cfg.rollout
        groups = []
        for p, record in enumerate(self.prompts):
            try:
                ids = self.job.encode(record)
            except Exception as exc:  # a tokenizer or template problem: name the prompt
                raise DataError(f"eval prompt {p}: cannot encode ({type(exc).__name__}: {exc})") from None
            groups.append([GenRequest(sample_id=(EVAL_STEP, p, s), prompt_ids=ids, max_new_tokens=rc.max_new_tokens,
                                      seed=derived_seed(self.cfg.seed, "eval", p, s))
                           for s in range(ec.samples_per_prompt)])
        return groups

    def run(self, step: int, cluster: Any, emit: Any, rel: Any) -> dict:
        """Evaluate the weights the rollout devices hold after `step`; emit and return the record.

        Raises `DevicesLost` (after the requests of a lost device went to the others) when a
        device was lost: the run recovers and evaluates again."""
        t0 = time.time()
        devices = cluster.assignment.devices(ROLLOUT)
        outcome = cluster.rollout(EVAL_STEP, self._groups, devices)
        cluster.raise_if_lost(f"eval after step {step}")
        for d, c0, c1 in outcome.calls:
            emit("span", device=d, name="eval", start_s=rel(c0), end_s=rel(c1), step=step)
        rec = self.score(step, [r for _, r in outcome.results])
        rec.update(eval_s=time.time() - t0, start_s=rel(t0), end_s=rel(time.time()))
        self.last = {k: v for k, v in rec.items() if k.startswith(("reward_", "pass_at_"))}
        return emit("eval", **rec)

    def score(self, step: int, results: list[Any]) -> dict:
        """The fields of the `eval` record of `results` (GenResults of every eval request)."""
        ec = self.cfg.eval
        n = ec.samples_per_prompt
        by_prompt: dict[int, list[float]] = {p: [] for p in range(len(self.prompts))}
        versions, tokens, errors, left_out = set(), 0, 0, 0
        for sid, value, fate in self._rewards(step, sorted(results, key=lambda r: r.sample_id)):
            by_prompt[sid[1]].append(value)
            errors += fate == "error"
            left_out += fate == "left out"
        for r in results:
            versions.add(r.version)
            tokens += len(r.response_ids)
        if any(len(v) != n for v in by_prompt.values()) or len(versions) != 1:
            raise RuntimeError(f"eval after step {step}: incomplete or mixed results "
                               f"({sum(map(len, by_prompt.values()))} samples, versions {sorted(versions)})")
        every = [v for vs in by_prompt.values() for v in vs]
        correct = [sum(1 for v in vs if v >= ec.correct_threshold) for vs in by_prompt.values()]
        out: dict = {"step": step, "version": versions.pop(), "reward_mean": statistics.fmean(every),
                     "reward_std": statistics.pstdev(every)}
        for k in pass_ks(n):
            out[f"pass_at_{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
        out.update(num_prompts=len(self.prompts), samples_per_prompt=n, num_samples=len(every),
                   correct_threshold=ec.correct_threshold, num_correct=sum(correct), num_response_tokens=tokens,
                   num_reward_errors=errors, num_left_out=left_out)
        return out

    def _rewards(self, step: int, results: list[Any]) -> list[tuple[tuple, float, str | None]]:
        """(sample id, reward, fate) of each result, scored as training samples are: in the job's
        reward pool with its deadline, in the reward's own style. A failed call follows
        `task.on_reward_error` (fail: `RewardError` naming the sample); a TRL None scores 0 here
        (pass@k needs every sample) and is counted as left out."""
        job, by_id = self.job, {r.sample_id: r for r in results}
        texts = {sid: tasks.decode_response(job.tokenizer, r.response_ids) for sid, r in by_id.items()}
        response_ids = {sid: r.response_ids for sid, r in by_id.items()}
        out = []
        for sid, value, problem in job.reward_outcomes(step, list(by_id), self.prompts, texts, response_ids):
            if problem is not None:
                if self.cfg.task.on_reward_error == "fail":
                    raise RewardError(f"eval after step {step}: {job.reward_reason(sid, problem)}")
                out.append((sid, 0.0, "error"))
            else:
                out.append((sid, 0.0, "left out") if value is None else (sid, float(value), None))
        return out

