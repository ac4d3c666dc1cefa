"""The training stage on a device worker: one step's forward, backward and optimizer step on
this rank's micro-batches, whole (`train`) or in parts as a streaming step's samples arrive
(`train_part`, docs/pipeline.md). A mixin of `cluster.worker.DeviceWorker`: it uses the
worker's trainer (`roles/train_fsdp.py`), config, fault points and moment hand-off
(cluster/handoff.py).

Micro-batch i of a step runs on the trainer at position i mod W, its composition fixed by
sample index, so a step's result does not depend on how many trainers there are or on how its
parts were cut.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from dynaresize.rl import grpo


class TrainStageMixin:
    """Training-step methods of `DeviceWorker` (see the module docstring)."""

    def _loss_fn(self, total_tokens: int | None, ref_logprobs: dict | None = None) -> Callable:
        """The loss of a micro-batch (`grpo.micro_batch_loss` with the run's `train.*` loss
        settings). `total_tokens`, the step's response tokens: each micro-batch's loss is
        divided by the step's loss denominator (`_loss_denominator`), so the step's loss is the
        sum over its micro-batches whichever trainer ran them; None: not divided (a streaming
        part: `train_part` scales the step's gradient once its last part is in)."""
        tc, temperature = self.cfg.train, self.cfg.rollout.temperature
        denominator = 1 if total_tokens is None else self._loss_denominator(total_tokens)
        lora_ref = tc.lora is not None and tc.kl_coef > 0

        def loss_fn(model: torch.nn.Module, mb: list | None) -> tuple[torch.Tensor, dict]:
            dummy = mb is None
            batch = grpo.dummy_micro_batch() if dummy else mb
            refs = None
            if self.trainer.ref is not None or lora_ref:
                # LoRA: the reference is the base the policy wraps, its adapter off (no second copy)
                with torch.no_grad(), (model.disable_adapter() if lora_ref else contextlib.nullcontext()):
                    refs = grpo.response_logprobs(model if lora_ref else self.trainer.ref, batch,
                                                  temperature=temperature, chunk_tokens=tc.logprob_chunk_tokens)
            stats: dict = {}
            loss = grpo.micro_batch_loss(model, batch, denominator=denominator, clip_eps=tc.clip_eps,
                                         clip_ratio_low=tc.clip_ratio_low, clip_ratio_high=tc.clip_ratio_high,
                                         clip_ratio_c=tc.clip_ratio_c, loss_agg_mode=tc.loss_agg_mode,
                                         max_response_tokens=self.cfg.rollout.max_new_tokens,
                                         entropy_coef=tc.entropy_coef, kl_coef=tc.kl_coef, ref_logprobs=refs,
                                         kl_estimator=tc.kl_estimator, temperature=temperature, stats=stats,
                                         chunk_tokens=tc.logprob_chunk_tokens)
            return (loss * 0.0, {}) if dummy else (loss, stats)

        return loss_fn

    def _loss_denominator(self, total_tokens: int, num_micro_batches: int | None = None) -> int:
        """The step's loss denominator (`grpo.loss_denominator`): its response tokens, or for the
        seq-mean modes its sequences. A step's sequences are fixed by the config (every prompt of
        the step, every sample of each: `Job.expected_ids`, each consumed once by the ledger), so
        every trainer knows them, whatever the share of the step it was given; a step of another
        size (as `num_micro_batches` shows) is refused."""
        rc, tc = self.cfg.rollout, self.cfg.train
        sequences = rc.prompts_per_step * rc.samples_per_prompt
        if (tc.loss_agg_mode != "token-mean" and num_micro_batches is not None
                and num_micro_batches != -(-sequences // tc.micro_batch_size)):
            raise ValueError(f"{num_micro_batches} micro-batches for a step of {sequences} sequences "
                             f"(train.loss_agg_mode={tc.loss_agg_mode!r} divides by the step's sequences)")
        return grpo.loss_denominator(tc.loss_agg_mode, tokens=total_tokens, sequences=sequences)

    def recompute_logprobs(self, micro_batches: list[tuple[int, list]], num_micro_batches: int,
                           rounds: int | None = None) -> dict:
        """Behaviour log-probs recomputed by the trainers with their current weights (collective
        over the training group; a rank without a micro-batch in a round runs a dummy)."""
        temperature, chunk = self.cfg.rollout.temperature, self.cfg.train.logprob_chunk_tokens
        out = self.trainer.forward_rounds(
            micro_batches, num_micro_batches,
            lambda model, mb: [lp.tolist() for lp in grpo.response_logprobs(
                model, grpo.dummy_micro_batch() if mb is None else mb, temperature=temperature, chunk_tokens=chunk)],
            rounds=rounds)
        return {i: lps for i, lps in out.items()}

    def train(self, step: int, micro_batches: list[tuple[int, list]], num_micro_batches: int,
              total_tokens: int, snapshot: tuple[int, str] | None = None) -> dict:
        """One training step on this rank's micro-batches (fixed composition by sample index).
        `snapshot` (version, kind): start that snapshot's host copy right after the optimizer
        step (`_optimizer_step`), so no call of its own sits on the step's path."""
        self._maybe_fault("train", step)
        self._pin_threads()
        t0 = time.time()
        micro_batches = self._with_old_logprobs(micro_batches, num_micro_batches)
        self.trainer.model.train()
        self._loss_denominator(total_tokens, num_micro_batches)  # a step of another size: refused before any work
        stats = self.trainer.compute_grads(micro_batches, self._loss_fn(total_tokens),
                                           num_micro_batches=num_micro_batches)
        return self._optimizer_step(stats, t0, snapshot)

    def train_part(self, step: int, micro_batches: list[tuple[int, list]], rounds: int, begin: bool,
                   num_micro_batches: int, total_tokens: int | None, snapshot: tuple[int, str] | None = None) -> dict:
        """Part of a streaming step's training (the trainers accumulate as a step's groups arrive):
        forward/backward of this rank's `micro_batches` over `rounds` rounds (every trainer gets
        the same `rounds`), added to the step's gradient (`begin`: its first part). The loss is
        not divided here; the last part (`total_tokens` given: the step's token count, known once
        its samples are all in) scales the gradient by 1 / the step's loss denominator
        (`_loss_denominator`) and applies the optimizer step, so the update equals `train` on the
        whole step."""
        if begin:
            self._maybe_fault("train", step)
            self._pin_threads()
            self.trainer.begin_grads()
        t0 = time.time()
        if rounds:
            micro_batches = self._with_old_logprobs(micro_batches, num_micro_batches, rounds=rounds)
            self.trainer.model.train()
            self.trainer.add_grads(micro_batches, self._loss_fn(None), rounds=rounds)
        if total_tokens is None:
            return {"t0": t0, "t1": time.time(), "device": self.device}
        denominator = self._loss_denominator(total_tokens, num_micro_batches)
        stats = self.trainer.reduce_grads(num_micro_batches=num_micro_batches, scale=1.0 / denominator)
        return self._optimizer_step(stats, t0, snapshot)

    def _with_old_logprobs(self, micro_batches: list[tuple[int, list]], num_micro_batches: int,
                           rounds: int | None = None) -> list[tuple[int, list]]:
        if self._old_logprobs() != "recompute":
            return micro_batches
        recomputed = self.recompute_logprobs(micro_batches, num_micro_batches, rounds=rounds)
        return [(i, [s.with_logprobs(lps) for s, lps in zip(mb, recomputed[i])]) for i, mb in micro_batches]

    def _optimizer_step(self, stats: dict, t0: float, snapshot: tuple[int, str] | None = None) -> dict:
        t_grads = time.time()
        # The moments of the last resize moved on this thread before this call (the driver queued
        # their hand-off first); a pending or failed hand-off stops the step (cluster/handoff.py).
        self.moments.require_done()
        snap_wait_s = self.snapshot_gate()  # a snapshot's host copy reads this state (worker_recovery.py)
        t_wait = time.time()
        stats.update(self.trainer.apply_optimizer())
        if snapshot is not None:  # the new version's copy starts now, on this thread (worker_recovery.py)
            self.snapshot_begin(*snapshot)
            stats["snapshot"] = [int(snapshot[0]), str(snapshot[1])]
        stats["snap_wait_s"] = snap_wait_s
        stats.update(t0=t0, t_grads=t_grads, t_wait=t_wait, t1=time.time(), device=self.device,
                     version=self.trainer.step)
        return stats
