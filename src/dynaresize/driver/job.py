"""What one RL step needs from the data side: requests, rewards, advantages, train samples.

Runs in the driver. Everything here is a function of (config, step, sample id): never of how
many devices each pool has. That is what keeps RL semantics fixed under resizes:
- the prompts of step k and their order come from `rl.data.prompts_for_step(seed, k)`;
- sample (k, p, s) gets seed `rl.seeds.sample_seed(seed, k, p, s)` and, in synthetic-length
  mode, the forced length `workload.sample_lengths(...)[p][s]` (keyed by absolute step);
- the samples of one prompt form one group, the unit the router dispatches, so an engine batch
  always holds the same samples;
- advantages (`algorithm.adv_estimator`) are taken per prompt group, or over the step's
  samples (the REINFORCE++ ones), never per device; micro-batches are fixed by sample id.

Rewards are computed in the reward pool (`rl.reward_pool`: `task.reward_workers` processes, a
deadline of `task.reward_timeout_s` per call), in the function's own style (`rl.rewards`). Each
sample's fate goes into the ledger with its sample id: its reward; or, when the function
raised, timed out, died or returned a non-number, the reason, and then `task.on_reward_error`
either stops the step (`fail`: RewardError) or scores it 0.0 (`zero`, in its group like any
reward). A TRL function's None leaves the sample out: the ledger's `reward_error` says so
(`left out: ...`, its `reward` is a 0.0 placeholder), its group's mean and std are taken over
the other samples, and its advantage is 0, so it moves no policy gradient; it stays in its
step's batch (consumed, micro-batches fixed by sample id), where it still counts in the
`token-mean` denominator and the KL and entropy terms. A group with fewer than two rewards left
has advantages 0.

Multi-turn tasks (`task.env`, rl/env.py): each request carries its prompt record for the
environment (`GenRequest.env_sample`); the worker's turn loop returns the whole trajectory
(roles/multiturn.py). Its reward is the sum of the environment's step rewards (no reward pool);
an environment that failed is handled as a reward error (`task.on_reward_error`, the reason in
the ledger). Each trajectory is one ledger entry with its turns and why it ended (a trajectory
cut by `task.max_turns` or `task.max_total_tokens` is consumed with that reason), and its train
sample carries the loss mask (the model's tokens only).
"""

from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass, field

from dynaresize.config import RunConfig
from dynaresize.driver.console import say
from dynaresize.driver.ledger import Ledger, sample_id_str, token_sha1
from dynaresize.errors import RewardError
from dynaresize.rl import data, grpo, tasks
from dynaresize.rl.advantages import compute_advantages
from dynaresize.rl.dapo import gen_batch_order, overlong_penalty
from dynaresize.rl.dataset import is_chat, prompt_key
from dynaresize.rl.models import encode_prompt, load_tokenizer
from dynaresize.rl.reward_pool import RewardPool
from dynaresize.rl.seeds import derived_seed, sample_seed
from dynaresize.roles.base import GenRequest, GenResult


@dataclass
class ScoredStep:
    samples: list[grpo.TrainSample]
    num_tokens: int
    longest_tokens: int
    rewards: list[float] = field(default_factory=list)  # of the samples with a reward (a left-out one has none)
    metric_values: dict[str, list[float]] = field(default_factory=dict)  # a dict reward's other keys, log_metric
    left_out: int = 0  # samples a TRL reward left out (None)
    filtering: dict | None = None  # algorithm.filter_groups: gen_batches, groups_kept, groups_filtered, groups_surplus

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / max(1, len(self.rewards))

    @property
    def reward_std(self) -> float:
        """Population std of the rewards (left-out samples are not in it)."""
        return statistics.pstdev(self.rewards) if self.rewards else 0.0

    @property
    def reward_metrics(self) -> dict[str, float]:
        """Each extra reward metric's mean over the step."""
        return {k: sum(v) / len(v) for k, v in sorted(self.metric_values.items()) if v}


@dataclass
class ScoredPart:
    """Some of a step's samples after the first phase of scoring (`Job.score_part`)."""

    by_id: dict  # sample id -> (device, GenResult)
    records: dict  # prompt index -> prompt record
    values: dict  # sample id -> reward (shaped; a left-out sample's 0.0 placeholder)
    left_out: set
    metrics: dict[str, list[float]]
    scores: dict  # sample id -> reward before overlong shaping
    per_sample: dict  # sample id -> {metric: value} of a one-sample reward call


class Job:
    """Prompt source, tokenizer and reward of a run (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        task = tasks.load_task(cfg.task)  # first: a bad dataset or reward is one line before transformers loads
        self.tokenizer = load_tokenizer(cfg.model)
        self.prompts = task.prompts
        self.task = task
        self._pool: RewardPool | None = None  # started on the first step's scoring
        self._prompt_ids: dict[str, list[int]] = {}  # by prompt text: positions hold other prompts each step
        self._own_template = bool(getattr(self.tokenizer, "chat_template", None))
        # Chat-message prompts (training or eval ones) with the built-in tokenizer, which has no
        # template: a small one of ours.
        self._chat_template = tasks.TINY_CHAT_TEMPLATE if not self._own_template and cfg.model.path is None else None
        self._check_lengths()
        if task.about:
            say(f"dynaresize: {task.about}")

    def reward_pool(self) -> RewardPool:
        """The run's reward workers (started on first use, stopped with the job or at exit)."""
        if self._pool is None:
            tc = self.cfg.task
            self._pool = RewardPool(self.task.reward_spec, self.task.reward_style, tc.reward_workers, tc.reward_timeout_s)
            weakref.finalize(self, self._pool.close)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _check_lengths(self) -> None:
        """Refuse (ConfigError, exit 2) what the model cannot take: a chat template it lacks,
        or prompt plus response longer than its positions."""
        from dynaresize.errors import ConfigError
        from dynaresize.rl.models import max_positions

        rc, errors = self.cfg.rollout, []
        if self.cfg.task.chat_template and not getattr(self.tokenizer, "chat_template", None):
            errors.append(f"task.chat_template=True: the tokenizer of model.path={self.cfg.model.path!r} "
                          "has no chat template")
        if not self._own_template and self._chat_template is None and any(is_chat(r["prompt"]) for r in self.prompts):
            errors.append(f"task {self.task.name!r}: its prompts are chat messages, and the tokenizer "
                          f"of model.path={self.cfg.model.path!r} has no chat template to render them")
        limit = max_positions(self.cfg.model)
        budget = self.cfg.task.max_total_tokens
        if self.task.env_spec is not None and budget and budget > limit:
            errors.append(f"task.max_total_tokens={budget}: exceeds the model's max_position_embeddings ({limit})")
        if self.task.env_spec is not None and rc.max_prompt_tokens >= (budget or limit):
            errors.append(f"rollout.max_prompt_tokens={rc.max_prompt_tokens}: leaves no room for a turn within "
                          f"task.max_total_tokens={budget or limit}")
        if self.task.env_spec is not None and self.cfg.reward.overlong_buffer_len:
            errors.append(f"reward.overlong_buffer_len={self.cfg.reward.overlong_buffer_len}: not with a multi-turn "
                          "task: its budget is task.max_total_tokens, over turns and observations")
        if rc.max_prompt_tokens + rc.max_new_tokens > limit:
            errors.append(f"rollout.max_prompt_tokens={rc.max_prompt_tokens}: plus rollout.max_new_tokens="
                          f"{rc.max_new_tokens} exceeds the model's max_position_embeddings ({limit})")
        if rc.synthetic_lengths:
            from pathlib import Path

            from dynaresize.workload import WORKLOADS

            by_model = self.cfg.algorithm.filter_groups and self.cfg.algorithm.filter_metric == "workload"
            if rc.length_workload in WORKLOADS and WORKLOADS[rc.length_workload].filter_share_end and not by_model:
                errors.append(f"rollout.length_workload={rc.length_workload!r}: a workload whose filtered groups are "
                              "modelled: run it with algorithm.filter_groups=true and algorithm.filter_metric=workload "
                              "(a run filtering by its own rewards takes another length workload)")
            elif rc.length_workload not in WORKLOADS and not Path(rc.length_workload).is_file():
                errors.append(f"rollout.length_workload={rc.length_workload!r}: neither a known workload "
                              f"({', '.join(WORKLOADS)}) nor a trace file")
            elif rc.length_horizon_steps and rc.length_workload not in WORKLOADS:
                errors.append(f"rollout.length_horizon_steps={rc.length_horizon_steps}: only a named workload has "
                              f"a horizon (rollout.length_workload is the trace {rc.length_workload!r})")
        if errors:
            raise ConfigError(errors)

    @property
    def gen_prompts(self) -> int:
        """Prompts per generation batch: G with `algorithm.filter_groups` (rl/dapo.py), else P."""
        rc = self.cfg.rollout
        return (rc.gen_prompts_per_step or rc.prompts_per_step) if self.cfg.algorithm.filter_groups \
            else rc.prompts_per_step

    def step_prompts(self, step: int, batch: int = 0) -> list[tuple[int, dict]]:
        """(prompt_index, record) of generation batch `batch` of `step` (without filtering, the
        step's only batch): prompt indices batch*G .. batch*G + G-1 (rl/dapo.py)."""
        g = self.gen_prompts
        order = gen_batch_order(len(self.prompts), step, batch, g, self.cfg.seed)
        return [(batch * g + j, self.prompts[i]) for j, i in enumerate(order)]

    def prompt_record(self, step: int, prompt_index: int) -> dict:
        batch, j = divmod(prompt_index, self.gen_prompts)
        return self.step_prompts(step, batch)[j][1]

    def requests(self, step: int, batch: int = 0) -> list[list[GenRequest]]:
        """The requests of generation batch `batch` of the step, one list per prompt group."""
        rc = self.cfg.rollout
        lengths = None
        g = self.gen_prompts
        if rc.synthetic_lengths:
            from dynaresize.workload import lengths_for_step

            k = rc.samples_per_prompt  # a named workload or a trace file, keyed by absolute step
            seed = self.cfg.seed if batch == 0 else derived_seed(self.cfg.seed, "gen-batch", batch)
            flat = lengths_for_step(rc.length_workload, step, g * k, seed,
                                    samples_per_prompt=k, max_tokens=rc.max_new_tokens,
                                    horizon_steps=rc.length_horizon_steps)
            lengths = [flat[i * k:(i + 1) * k] for i in range(g)]
        groups = []
        for p, (prompt_index, record) in enumerate(self.step_prompts(step, batch)):
            ids = self._encode(record)
            env_sample = dict(record) if self.task.env_spec is not None else None
            groups.append([
                GenRequest(sample_id=(step, prompt_index, s), prompt_ids=ids, max_new_tokens=rc.max_new_tokens,
                           seed=sample_seed(self.cfg.seed, step, prompt_index, s),
                           forced_length=None if lengths is None else int(lengths[p][s]), env_sample=env_sample)
                for s in range(rc.samples_per_prompt)])
        return groups

    def expected_ids(self, step: int, batches: int = 1) -> list[tuple[int, int, int]]:
        """The sample ids of the step's first `batches` generation batches."""
        return [(step, p, s) for b in range(batches) for p, _ in self.step_prompts(step, b)
                for s in range(self.cfg.rollout.samples_per_prompt)]

    def encode(self, record: dict) -> list[int]:
        """The prompt ids of a prompt record, as the rollout sees them (also for evaluation)."""
        return self._encode(record)

    def _encode(self, record: dict) -> list[int]:
        """Prompt ids: chat messages rendered with the chat template (the tokenizer's, or for the
        built-in one `tasks.TINY_CHAT_TEMPLATE`), a string as one user turn of it
        (`task.chat_template`) or as is; then truncated to the last `rollout.max_prompt_tokens`
        (the end holds the question)."""
        prompt = record["prompt"]
        key = prompt_key(prompt)
        if key not in self._prompt_ids:
            if is_chat(prompt) or self.cfg.task.chat_template:
                messages = prompt if is_chat(prompt) else [{"role": "user", "content": prompt}]
                chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          chat_template=self._chat_template)
                ids = list(self.tokenizer(chat, add_special_tokens=False)["input_ids"])
            else:
                ids = encode_prompt(self.tokenizer, prompt)
            self._prompt_ids[key] = ids[-self.cfg.rollout.max_prompt_tokens:]
        return self._prompt_ids[key]

    def score(self, step: int, results: list[tuple[int, GenResult]], ledger: Ledger) -> ScoredStep:
        """Rewards (in the reward pool), ledger entries and advantages for the samples of `step`
        (see the module docstring for each sample's fate)."""
        part = self.score_part(step, results, ledger)
        return self.assemble(step, [part], sorted(part.values))

    def score_part(self, step: int, results: list[tuple[int, GenResult]], ledger: Ledger) -> "ScoredPart":
        """The first phase of scoring, for some of a step's samples (a generation batch): each is
        noted generated in the ledger, rewarded (and shaped: `reward.overlong_buffer_len`), and
        its metric for dynamic sampling taken (`algorithm.filter_metric`)."""
        by_id = {r.sample_id: (d, r) for d, r in results}
        ordered = sorted(by_id)
        records = {sid[1]: self.prompt_record(step, sid[1]) for sid in ordered}
        texts = {}
        for sid in ordered:
            device, res = by_id[sid]
            ledger.generated(sample_id=sid, version=res.version, device=device, num_tokens=len(res.response_ids),
                             token_sha1=token_sha1(res.response_ids),
                             seed=sample_seed(self.cfg.seed, *sid), versions=res.versions, turns=res.turns,
                             stop_reason=res.stop_reason)
            texts[sid] = tasks.decode_response(self.tokenizer, res.response_ids)
        per_sample: dict = {}
        values, left_out, metrics, scores = self._rewards(step, ordered, records, texts, by_id, ledger, per_sample)
        return ScoredPart(by_id=by_id, records=records, values=values, left_out=left_out, metrics=metrics,
                          scores=scores, per_sample=per_sample)

    def filter_values(self, part: "ScoredPart") -> dict[int, list[float | None]]:
        """Each prompt group's `algorithm.filter_metric` values (None: a left-out sample)."""
        name = self.cfg.algorithm.filter_metric
        groups: dict[int, list[float | None]] = {}
        for sid in sorted(part.values):
            if sid in part.left_out:
                value = None
            elif name == "reward":
                value = part.values[sid]
            elif name == "score":
                value = part.scores[sid]
            elif name in part.per_sample.get(sid, {}):
                value = part.per_sample[sid][name]
            else:
                from dynaresize.errors import ConfigError

                raise ConfigError([f"algorithm.filter_metric={name!r}: sample {sample_id_str(sid)} has no such metric "
                                   f"(reward, score, or a key the reward function returns per sample: "
                                   f"{', '.join(sorted(part.per_sample.get(sid, {}))) or 'none'})"])
            groups.setdefault(sid[1], []).append(value)
        return groups

    def assemble(self, step: int, parts: list["ScoredPart"], ids: list[tuple[int, int, int]],
                 filtering: dict | None = None) -> ScoredStep:
        """The step's train samples from its consumed ids `ids` (all of its samples, or under
        dynamic sampling those of the chosen groups), with their advantages."""
        by_id, values, left_out, metrics = {}, {}, set(), {}
        for part in parts:
            by_id.update(part.by_id)
            values.update(part.values)
            left_out |= part.left_out
            for key, vals in part.metrics.items():
                metrics.setdefault(key, []).extend(vals)
        ordered = sorted(ids)
        advantages = self.advantages([values[sid] for sid in ordered],
                                     [_model_tokens(by_id[sid][1]) for sid in ordered],
                                     [sid not in left_out for sid in ordered])
        samples = [grpo.TrainSample(sample_id=sid, prompt_ids=self._encode(self.prompt_record(step, sid[1])),
                                    response_ids=list(by_id[sid][1].response_ids),
                                    rollout_logprobs=list(by_id[sid][1].logprobs), advantage=adv,
                                    loss_mask=tuple(by_id[sid][1].loss_mask))
                   for sid, adv in zip(ordered, advantages)]
        num_tokens = sum(len(s.response_ids) for s in samples)
        scored = [values[sid] for sid in ordered if sid not in left_out]
        return ScoredStep(samples=samples, rewards=scored, num_tokens=num_tokens,
                          longest_tokens=max((len(s.response_ids) for s in samples), default=0),
                          metric_values=metrics, left_out=len(left_out.intersection(ordered)), filtering=filtering)

    def _rewards(self, step: int, ordered: list, records: dict, texts: dict, by_id: dict,
                 ledger: Ledger, per_sample: dict) -> tuple[dict, set, dict[str, list[float]], dict]:
        """Each sample's reward from the pool, its fate noted in the ledger: (value by sample
        id, the ids left out, metric values, score before overlong shaping by sample id). One
        call per sample, or per prompt group (trl); `per_sample` receives a one-sample call's
        own metrics by sample id."""
        values: dict = {}
        scores: dict = {}
        left_out: set = set()
        metrics: dict[str, list[float]] = {}
        response_ids = {sid: by_id[sid][1].response_ids for sid in ordered}
        if self.task.env_spec is not None:  # the environment's rewards, its failures as reward errors
            outcomes = [(sid, by_id[sid][1].env_reward, by_id[sid][1].env_error) for sid in ordered]
        else:
            outcomes = self.reward_outcomes(step, ordered, records, texts, response_ids, metrics, per_sample)
        rc, shaping = self.cfg.rollout, self.cfg.reward
        for sid, value, problem in outcomes:
            if problem is None and value is None:  # a TRL None: left out, recorded
                left_out.add(sid)
                values[sid] = 0.0
                ledger.scored(sid, 0.0, f"left out: {self.reward_reason(sid, 'returned None')} (no reward, "
                                        "advantage 0, not in its group's mean and std)")
                continue
            reason = None if problem is None else self.reward_reason(sid, problem)
            if reason is not None and self.cfg.task.on_reward_error == "fail":
                raise RewardError(reason)
            scores[sid] = 0.0 if reason is not None else value
            penalty = overlong_penalty(len(response_ids[sid]), max_tokens=rc.max_new_tokens,
                                       buffer_len=shaping.overlong_buffer_len, factor=shaping.overlong_penalty_factor)
            values[sid] = scores[sid] + penalty
            ledger.scored(sid, values[sid], reason,
                          overlong_penalty=penalty if shaping.overlong_buffer_len else None)
        return values, left_out, metrics, scores

    def reward_outcomes(self, step: int, ordered: list, records: dict | list, texts: dict, response_ids: dict,
                        metrics: dict[str, list[float]] | None = None, per_sample: dict | None = None) -> list[tuple]:
        """(sample id, value, problem) of each sample of `ordered`, scored in the reward pool:
        one call per sample, or per prompt group (trl); records by prompt index. A value None
        without a problem is a TRL None. The calls' metrics are added to `metrics`, and a
        one-sample call's (one value each) to `per_sample` by sample id."""
        if self.task.reward_style != "trl":
            batches = [[sid] for sid in ordered]
        else:
            batches = [[sid for sid in ordered if sid[1] == p] for p in dict.fromkeys(s[1] for s in ordered)]
        group = self.task.reward_style == "trl"
        calls = [{"step": step, "prompts": [records[sid[1]]["prompt"] for sid in b],
                  "completions": [texts[sid] for sid in b],
                  "completion_ids": [list(response_ids[sid]) if group else [] for sid in b],
                  "fields": [data.reward_fields(records[sid[1]]) for sid in b]} for b in batches]
        out = []
        for batch, (kind, result) in zip(batches, self.reward_pool().run(calls)):
            if kind != "ok":  # the whole call failed: every sample of it has that problem
                out += [(sid, None, result) for sid in batch]
                continue
            for key, vals in result["metrics"].items():
                if metrics is not None:
                    metrics.setdefault(key, []).extend(vals)
                if per_sample is not None and len(batch) == 1 and len(vals) == 1:
                    per_sample.setdefault(batch[0], {})[key] = vals[0]
            out += list(zip(batch, result["values"], result["problems"]))
        return out

    def reward_reason(self, sid: tuple, problem: str) -> str:
        """One line naming the sample and the reward function (or the environment that failed)."""
        if self.task.env_spec is not None:
            return f"sample {sample_id_str(sid)}: {problem}"
        return " ".join(f"sample {sample_id_str(sid)}: reward function {self.task.reward_spec} {problem}".split())

    def advantages(self, rewards: list[float], num_tokens: list[int], present: list[bool]) -> list[float]:
        """The advantages of a step's consumed samples in sample-id order (`algorithm.adv_estimator`,
        rl/advantages.py); a left-out sample (present False) is in no statistic and gets 0."""
        tc = self.cfg.train
        return compute_advantages(self.cfg.algorithm.adv_estimator, rewards, self.cfg.rollout.samples_per_prompt,
                                  num_tokens=num_tokens, present=present, norm_by_std=tc.norm_adv_by_std,
                                  std=tc.adv_std)


def _model_tokens(res: GenResult) -> int:
    """n_s of rl/advantages.py: the response tokens the loss counts (the model's own)."""
    return sum(1 for m in res.loss_mask if m) if res.loss_mask else len(res.response_ids)
