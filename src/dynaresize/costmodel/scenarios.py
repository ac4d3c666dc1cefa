"""A simulation scenario: the workload (named model or trace), the cluster, the model preset.

Batch size: `prompts_per_step` defaults to the workload's own batch where it names one (the
`dapo-qwen3-8b` recipe's 32 prompts), else 2 prompts x 16 samples per device, i.e. 32 samples
per device and step (RollPacker's Qwen2.5-14B setting: 128 prompts x 8 samples on 32 GPUs,
docs/references.md 2.1). It does not change with the split: RL semantics fix the batch.

Bounds: min_rollout = one replica (tp devices), move unit = tp, min_train = the memory floor of
the training state (`costs.min_train_devices`), never below the user's PolicyConfig values;
`PolicyConfig.allowed_rollout` (predefined splits) passes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dynaresize.config import PolicyConfig
from dynaresize.costmodel.costs import (Hardware, ModelPreset, get_hardware, get_model, min_train_devices, with_lora,
                                        with_sync)
from dynaresize.costmodel.stages import Batch, StageModel
from dynaresize.errors import ConfigError
from dynaresize.types import Bounds
from dynaresize.workload import SAMPLES_PER_PROMPT, batch_for_step, get_workload

PROMPTS_PER_DEVICE = 2


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str  # the workload name, or the trace path
    num_devices: int
    num_steps: int
    model: ModelPreset
    seed: int = 0
    prompts_per_step: int = 0
    samples_per_prompt: int = SAMPLES_PER_PROMPT
    batch_of: Callable[[int], Batch] = field(repr=False, compare=False, default=None)
    trace_samples: int | None = None  # a trace's trained samples over num_steps steps
    hardware: Hardware = Hardware()  # the accelerator every device is

    def total_samples(self) -> int:
        """Samples trained over the run (every step trains one batch)."""
        return self.trace_samples if self.trace_samples is not None else self.samples_per_step * self.num_steps

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def bounds(self, cfg: PolicyConfig = PolicyConfig()) -> Bounds:
        tp = self.model.rollout_tp
        unit = max(cfg.move_unit, tp)
        if unit % tp:
            raise ConfigError([f"policy.move_unit={cfg.move_unit}: must be a multiple of the rollout TP size {tp}"])
        min_rollout = max(cfg.min_rollout, tp)
        min_rollout = -(-min_rollout // unit) * unit
        b = Bounds(num_devices=self.num_devices, min_rollout=min_rollout,
                   min_train=max(cfg.min_train, min_train_devices(self.model, self.hardware)), move_unit=unit,
                   allowed_rollout=tuple(cfg.allowed_rollout))
        if not b.splits():
            raise ConfigError([f"devices={self.num_devices}: too few for model {self.model.name} "
                               f"(rollout needs >= {b.min_rollout}, training >= {b.min_train})"])
        return b

    def stages(self, batch_cache: int = 4) -> StageModel:
        """The stage model on this scenario's hardware; `batch_cache` batches' arrays are kept (the
        streaming pipeline and its sweeps revisit batches, so they keep up to ~4M samples' worth)."""
        return StageModel(self.model, self.batch_of, self.hardware, batch_cache=batch_cache)


def workload_scenario(workload: str, *, num_devices: int, num_steps: int, model: str = "7b", seed: int = 0,
                      prompts_per_step: int | None = None, horizon_steps: int | None = None,
                      accelerator: str = "h100", weight_sync: str = "full",
                      changed_fraction: float | None = None, lora_rank: int = 0,
                      lora_targets: tuple[str, ...] = ("all-linear",)) -> Scenario:
    """The named workload's job on `num_devices` (`prompts_per_step` x 16 samples; by default the
    workload's own batch where it names one, else 2 prompts per device), its time constants over
    `horizon_steps` (None: the workload's own), on `accelerator` (a `HARDWARE_PRESETS` name),
    syncing weights in `weight_sync` mode at `changed_fraction` (`costs.with_sync`), training a
    rank-`lora_rank` LoRA adapter on `lora_targets` (0: every weight; `costs.with_lora`)."""
    spec = get_workload(workload)  # an unknown name is a ConfigError before anything runs
    _check(num_devices, num_steps)
    prompts = prompts_per_step or spec.prompts_per_step or PROMPTS_PER_DEVICE * num_devices

    def batch_of(b: int) -> Batch:  # the runtime's emulator calls the same function (emulate/model.py)
        return batch_for_step(workload, b, prompts * SAMPLES_PER_PROMPT, seed, samples_per_prompt=SAMPLES_PER_PROMPT,
                              horizon_steps=horizon_steps)

    return Scenario(name=workload, num_devices=num_devices, num_steps=num_steps,
                    model=_model(model, weight_sync, changed_fraction, lora_rank, lora_targets), seed=seed,
                    prompts_per_step=prompts, batch_of=batch_of, hardware=get_hardware(accelerator))


def trace_scenario(batches: list[Batch], name: str, *, num_devices: int, num_steps: int | None, model: str = "7b",
                   seed: int = 0, accelerator: str = "h100", weight_sync: str = "full",
                   changed_fraction: float | None = None, lora_rank: int = 0,
                   lora_targets: tuple[str, ...] = ("all-linear",)) -> Scenario:
    steps = len(batches) if num_steps is None else min(num_steps, len(batches))
    _check(num_devices, steps)
    mean_samples = int(round(np.mean([b.num_samples for b in batches[:steps]])))
    return Scenario(name=name, num_devices=num_devices, num_steps=steps,
                    model=_model(model, weight_sync, changed_fraction, lora_rank, lora_targets), seed=seed,
                    prompts_per_step=max(mean_samples, 1), samples_per_prompt=1, batch_of=lambda b: batches[b],
                    trace_samples=sum(b.num_samples for b in batches[:steps]), hardware=get_hardware(accelerator))


def _model(name: str, weight_sync: str, changed_fraction: float | None, lora_rank: int,
           lora_targets: tuple[str, ...]) -> ModelPreset:
    return with_lora(with_sync(get_model(name), weight_sync, changed_fraction), lora_rank, lora_targets)


def _check(num_devices: int, num_steps: int) -> None:
    errors = []
    if num_devices < 2:
        errors.append(f"devices={num_devices}: needs at least 2 devices")
    if num_steps < 1:
        errors.append(f"steps={num_steps}: needs at least 1 step")
    if errors:
        raise ConfigError(errors)
