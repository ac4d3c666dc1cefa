"""What one RL step needs from the data side: requests, rewards, advantages, train samples.

Runs in the driver. Everything here is a function of (config, step, sample id): never of how
many devices each pool has. That is what keeps RL semantics fixed under resizes:
- the prompts of step k and their order come from `rl.data.prompts_for_step(seed, k)`;
- sample (k, p, s) gets seed `rl.seeds.sample_seed(seed, k, p, s)` and, in synthetic-length
  mode, the forced length `workload.sample_lengths(...)[p][s]` (keyed by absolute step);
- the samples of one prompt form one group, the unit the router dispatches, so an engine batch
  always holds the same samples;
- advantages are normalised per prompt group, and micro-batches are fixed by sample id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dynaresize.config import RunConfig
from dynaresize.driver.ledger import Ledger, token_sha1
from dynaresize.rl import data, grpo, rewards, tasks
from dynaresize.rl.models import encode_prompt, load_tokenizer
from dynaresize.rl.seeds import sample_seed
from dynaresize.roles.base import GenRequest, GenResult


@dataclass
class ScoredStep:
    samples: list[grpo.TrainSample]
    mean_reward: float
    num_tokens: int
    longest_tokens: int


class Job:
    """Prompt source, tokenizer and reward of a run (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        task = tasks.load_task(cfg.task)
        self.prompts = task.prompts
        self.reward_fn: Callable[..., Any] = task.reward_fn
        self._prompt_ids: dict[str, list[int]] = {}  # by prompt text: positions hold other prompts each step
        self._check_lengths()

    def _check_lengths(self) -> None:
        """Refuse (ConfigError, exit 2) what the model cannot take: a chat template it lacks,
        or prompt plus response longer than its positions."""
        from dynaresize.errors import ConfigError
        from dynaresize.rl.models import max_positions

        rc, errors = self.cfg.rollout, []
        if self.cfg.task.chat_template and not getattr(self.tokenizer, "chat_template", None):
            errors.append(f"task.chat_template=True: the tokenizer of model.path={self.cfg.model.path!r} "
                          "has no chat template")
        limit = max_positions(self.cfg.model)
        if rc.max_prompt_tokens + rc.max_new_tokens > limit:
            errors.append(f"rollout.max_prompt_tokens={rc.max_prompt_tokens}: plus rollout.max_new_tokens="
                          f"{rc.max_new_tokens} exceeds the model's max_position_embeddings ({limit})")
        if rc.synthetic_lengths:
            from pathlib import Path

            from dynaresize.workload import WORKLOADS

            if rc.length_workload not in WORKLOADS and not Path(rc.length_workload).is_file():
                errors.append(f"rollout.length_workload={rc.length_workload!r}: neither a known workload "
                              f"({', '.join(WORKLOADS)}) nor a trace file")
            elif rc.length_horizon_steps and rc.length_workload not in WORKLOADS:
                errors.append(f"rollout.length_horizon_steps={rc.length_horizon_steps}: only a named workload has "
                              f"a horizon (rollout.length_workload is the trace {rc.length_workload!r})")
        if errors:
            raise ConfigError(errors)

    def step_prompts(self, step: int) -> list[tuple[int, dict]]:
        return data.prompts_for_step(self.prompts, step, self.cfg.rollout.prompts_per_step, self.cfg.seed)

    def requests(self, step: int) -> list[list[GenRequest]]:
        """The step's requests, one list per prompt group."""
        rc = self.cfg.rollout
        lengths = None
        if rc.synthetic_lengths:
            from dynaresize.workload import lengths_for_step

            k = rc.samples_per_prompt  # a named workload or a trace file, keyed by absolute step
            flat = lengths_for_step(rc.length_workload, step, rc.prompts_per_step * k, self.cfg.seed,
                                    samples_per_prompt=k, max_tokens=rc.max_new_tokens,
                                    horizon_steps=rc.length_horizon_steps)
            lengths = [flat[i * k:(i + 1) * k] for i in range(rc.prompts_per_step)]
        groups = []
        for p, (prompt_index, record) in enumerate(self.step_prompts(step)):
            ids = self._encode(record)
            groups.append([
                GenRequest(sample_id=(step, prompt_index, s), prompt_ids=ids, max_new_tokens=rc.max_new_tokens,
                           seed=sample_seed(self.cfg.seed, step, prompt_index, s),
                           forced_length=None if lengths is None else int(lengths[p][s]))
                for s in range(rc.samples_per_prompt)])
        return groups

    def expected_ids(self, step: int) -> list[tuple[int, int, int]]:
        return [(step, p, s) for p, _ in self.step_prompts(step) for s in range(self.cfg.rollout.samples_per_prompt)]

    def encode(self, record: dict) -> list[int]:
        """The prompt ids of a prompt record, as the rollout sees them (also for evaluation)."""
        return self._encode(record)

    def _encode(self, record: dict) -> list[int]:
        """Prompt ids: as one user turn of the chat template (`task.chat_template`) or as is,
        then truncated to the last `rollout.max_prompt_tokens` (the end holds the question)."""
        text = record["prompt"]
        if text not in self._prompt_ids:
            if self.cfg.task.chat_template:
                chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
                ids = list(self.tokenizer(chat, add_special_tokens=False)["input_ids"])
            else:
                ids = encode_prompt(self.tokenizer, text)
            self._prompt_ids[text] = ids[-self.cfg.rollout.max_prompt_tokens:]
        return self._prompt_ids[text]

    def score(self, step: int, results: list[tuple[int, GenResult]], ledger: Ledger) -> ScoredStep:
        """Rewards, ledger entries and group-relative advantages for the samples of `step`."""
        by_id = {r.sample_id: (d, r) for d, r in results}
        records = dict(self.step_prompts(step))
        ordered = sorted(by_id)
        rewards_out: list[float] = []
        for sid in ordered:
            device, res = by_id[sid]
            ledger.generated(sample_id=sid, version=res.version, device=device, num_tokens=len(res.response_ids),
                             token_sha1=token_sha1(res.response_ids),
                             seed=sample_seed(self.cfg.seed, *sid))
            record = records[sid[1]]
            text = tasks.decode_response(self.tokenizer, res.response_ids)
            fields = data.reward_fields(record)
            value, error = rewards.score(self.reward_fn, record["prompt"], text, fields, self.cfg.task.on_reward_error)
            ledger.scored(sid, value, error)
            rewards_out.append(value)
        tc = self.cfg.train
        advantages = grpo.group_advantages(rewards_out, self.cfg.rollout.samples_per_prompt,
                                           norm_by_std=tc.norm_adv_by_std, std=tc.adv_std)
        samples = [grpo.TrainSample(sample_id=sid, prompt_ids=self._encode(records[sid[1]]),
                                    response_ids=list(by_id[sid][1].response_ids),
                                    rollout_logprobs=list(by_id[sid][1].logprobs), advantage=adv)
                   for sid, adv in zip(ordered, advantages)]
        num_tokens = sum(len(s.response_ids) for s in samples)
        return ScoredStep(samples=samples, mean_reward=sum(rewards_out) / max(1, len(rewards_out)),
                          num_tokens=num_tokens, longest_tokens=max((len(s.response_ids) for s in samples), default=0))
