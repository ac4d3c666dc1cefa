"""The training stage on a device worker: one step's forward, backward and optimizer step on
this rank's micro-batches, whole (`train`) or in parts as a streaming step's samples arrive
(`train_part`, docs/pipeline.md). A mixin of `cluster.worker.DeviceWorker`: it uses the
worker's trainer (`roles/train_fsdp.py`), config, fault points and moment threads.

Micro-batch i of a step runs on the trainer at position i mod W, its composition fixed by
sample index, so a step's result does not depend on how many trainers there are or on how its
parts were cut.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from dynaresize.rl import grpo


class TrainStageMixin:
    """Training-step methods of `DeviceWorker` (see the module docstring)."""

    def _loss_fn(self, total_tokens: int, ref_logprobs: dict | None) -> Callable:
        tc, temperature = self.cfg.train, self.cfg.rollout.temperature

        def loss_fn(model: torch.nn.Module, mb: list | None) -> tuple[torch.Tensor, dict]:
            dummy = mb is None
            batch = grpo.dummy_micro_batch() if dummy else mb
            refs = None
            if self.trainer.ref is not None:
                with torch.no_grad():
                    refs = grpo.response_logprobs(self.trainer.ref, batch, temperature=temperature)
            stats: dict = {}
            loss = grpo.micro_batch_loss(model, batch, total_response_tokens=total_tokens, clip_eps=tc.clip_eps,
                                         kl_coef=tc.kl_coef, ref_logprobs=refs, kl_estimator=tc.kl_estimator,
                                         temperature=temperature, stats=stats)
            return (loss * 0.0, {}) if dummy else (loss, stats)

        return loss_fn

    def recompute_logprobs(self, micro_batches: list[tuple[int, list]], num_micro_batches: int,
                           rounds: int | None = None) -> dict:
        """Behaviour log-probs recomputed by the trainers with their current weights (collective
        over the training group; a rank without a micro-batch in a round runs a dummy)."""
        temperature = self.cfg.rollout.temperature
        out = self.trainer.forward_rounds(
            micro_batches, num_micro_batches,
            lambda model, mb: [lp.tolist() for lp in grpo.response_logprobs(
                model, grpo.dummy_micro_batch() if mb is None else mb, temperature=temperature)], rounds=rounds)
        return {i: lps for i, lps in out.items()}

    def train(self, step: int, micro_batches: list[tuple[int, list]], num_micro_batches: int,
              total_tokens: int) -> dict:
        """One training step on this rank's micro-batches (fixed composition by sample index)."""
        self._maybe_fault("train", step)
        self._pin_threads()
        t0 = time.time()
        micro_batches = self._with_old_logprobs(micro_batches, num_micro_batches)
        self.trainer.model.train()
        stats = self.trainer.compute_grads(micro_batches, self._loss_fn(total_tokens, None),
                                           num_micro_batches=num_micro_batches)
        return self._optimizer_step(stats, t0)

    def train_part(self, step: int, micro_batches: list[tuple[int, list]], rounds: int, begin: bool,
                   num_micro_batches: int, total_tokens: int | None) -> dict:
        """Part of a streaming step's training (the trainers accumulate as a step's groups arrive):
        forward/backward of this rank's `micro_batches` over `rounds` rounds (every trainer gets
        the same `rounds`), added to the step's gradient (`begin`: its first part). The loss is a
        sum over tokens here; the last part (`total_tokens` given: the step's token count, known
        once its samples are all in) scales the gradient by 1 / total_tokens and applies the
        optimizer step, so the update equals `train` on the whole step."""
        if begin:
            self._maybe_fault("train", step)
            self._pin_threads()
            self.trainer.begin_grads()
        t0 = time.time()
        if rounds:
            micro_batches = self._with_old_logprobs(micro_batches, num_micro_batches, rounds=rounds)
            self.trainer.model.train()
            self.trainer.add_grads(micro_batches, self._loss_fn(1, None), rounds=rounds)
        if total_tokens is None:
            return {"t0": t0, "t1": time.time(), "device": self.device}
        stats = self.trainer.reduce_grads(num_micro_batches=num_micro_batches, scale=1.0 / max(total_tokens, 1))
        return self._optimizer_step(stats, t0)

    def _with_old_logprobs(self, micro_batches: list[tuple[int, list]], num_micro_batches: int,
                           rounds: int | None = None) -> list[tuple[int, list]]:
        if self._old_logprobs() != "recompute":
            return micro_batches
        recomputed = self.recompute_logprobs(micro_batches, num_micro_batches, rounds=rounds)
        return [(i, [s.with_logprobs(lps) for s, lps in zip(mb, recomputed[i])]) for i, mb in micro_batches]

    def _optimizer_step(self, stats: dict, t0: float) -> dict:
        t_grads = time.time()
        # The moments of the last resize moved on this thread before this call (the driver queued
        # their hand-off first); a pending or failed hand-off stops the step (cluster/handoff.py).
        self.moments.require_done()
        t_wait = time.time()
        stats.update(self.trainer.apply_optimizer())
        stats.update(t0=t0, t_grads=t_grads, t_wait=t_wait, t1=time.time(), device=self.device,
                     version=self.trainer.step)
        return stats
