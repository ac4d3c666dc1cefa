"""Training a streaming step while its samples arrive (`train.staleness >= 2`, docs/pipeline.md).

The trainers of step k run forward and backward on each micro-batch of k as soon as its
samples are generated and scored, and accumulate the gradient; the optimizer step follows the
step's last micro-batch. The update equals training the whole step at once:

- a micro-batch is fixed by sample index (`grpo.micro_batches`: the step's samples sorted by
  id, cut every `micro_batch_size`), never by arrival order, and goes to the trainer at
  position i mod W as in a whole-step `Cluster.train`;
- a sample is scored only with its whole prompt group (GRPO advantages are per group), so a
  micro-batch is ready once every group it touches is complete;
- the loss of a step is a sum over its tokens divided by their count: the parts add the sum,
  the last part (the count is known once every sample is in) scales the gradient once.

This module is the bookkeeping (pure: no Ray, no torch): which groups are complete, which
micro-batches are ready, and the step's scored samples once all are in.
"""

from __future__ import annotations

from typing import Any, Sequence

from dynaresize.driver.job import ScoredStep
from dynaresize.rl import grpo


class StepAccumulator:
    """One step's samples as they arrive (see the module docstring)."""

    def __init__(self, step: int, sample_ids: Sequence[tuple[int, int, int]], *, micro_batch_size: int,
                 samples_per_prompt: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.step = step
        ids = sorted(tuple(s) for s in sample_ids)
        self.micro_batch_ids = [ids[i:i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]
        self.group_size = samples_per_prompt
        self._expected = set(ids)
        self._taken = 0  # results of the step's buffer already looked at
        self._waiting: dict[tuple[int, int], list[tuple[int, Any]]] = {}  # prompt -> its results so far
        self._seen: set = set()
        self.samples: dict[tuple[int, int, int], grpo.TrainSample] = {}
        self._parts: list[ScoredStep] = []
        self.sent: set[int] = set()

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batch_ids)

    @property
    def done(self) -> bool:
        """Every micro-batch of the step has been handed out."""
        return len(self.sent) == self.num_micro_batches

    def complete_groups(self, results: Sequence[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
        """The prompt groups completed by the results appended to the step's buffer since the
        last call (`results` only grows; (device, GenResult) pairs, a sample once)."""
        new, self._taken = list(results[self._taken:]), len(results)
        out = []
        for d, res in new:
            sid = tuple(res.sample_id)
            if sid not in self._expected or sid in self._seen:
                raise ValueError(f"step {self.step}: unexpected or repeated sample {sid}")
            self._seen.add(sid)
            group = self._waiting.setdefault(sid[:2], [])
            group.append((d, res))
            if len(group) == self.group_size:
                out.append(self._waiting.pop(sid[:2]))
        return out

    def add_scored(self, part: ScoredStep) -> None:
        """Scored samples of complete groups (`Job.score` on those groups)."""
        self._parts.append(part)
        for s in part.samples:
            self.samples[tuple(s.sample_id)] = s

    def restart(self) -> None:
        """The trainers lost what they had accumulated (a recovery restored the state before the
        step): every micro-batch is handed out again; scored samples stay scored (a sample is
        scored, and enters the ledger, once)."""
        self.sent.clear()

    def take_ready(self) -> list[tuple[int, list[grpo.TrainSample]]]:
        """Micro-batches (index, samples) whose samples are all scored and not handed out yet,
        by index; they are marked handed out."""
        out = []
        for i, ids in enumerate(self.micro_batch_ids):
            if i not in self.sent and all(sid in self.samples for sid in ids):
                out.append((i, [self.samples[sid] for sid in ids]))
                self.sent.add(i)
        return out

    @property
    def total_tokens(self) -> int:
        """The step's loss denominator (`grpo.total_response_tokens`); needs every sample."""
        if len(self.samples) != len(self._expected):
            raise ValueError(f"step {self.step}: {len(self.samples)} of {len(self._expected)} samples scored")
        return grpo.total_response_tokens(list(self.samples.values()))

    def scored_step(self) -> ScoredStep:
        """The whole step, as `Job.score` of all its samples at once would give it."""
        samples = [self.samples[sid] for ids in self.micro_batch_ids for sid in ids]
        metrics: dict[str, list[float]] = {}
        for p in self._parts:
            for k, v in p.metric_values.items():
                metrics.setdefault(k, []).extend(v)
        return ScoredStep(samples=samples, rewards=[r for p in self._parts for r in p.rewards],
                          metric_values=metrics, left_out=sum(p.left_out for p in self._parts),
                          num_tokens=sum(len(s.response_ids) for s in samples),
                          longest_tokens=max((len(s.response_ids) for s in samples), default=0))
