"""Emulated accelerators: how long each piece of real work would take on `ACCEL:MODEL`.

With `cluster.emulate = "h100:7b"` every device worker does its real work (the tiny model
really generates, trains, syncs and reshards) and then waits until the time this module gives
for that work on the named accelerator and model (cluster/pacing.py), scaled by
`cluster.time_scale` (emulated seconds per wall second). So N CPU workers behave as N
independent accelerators while they sleep most of the time, and moving a device between pools
changes the compute each pool has, as it does on a GPU cluster.

Every duration comes from the cost model's functions that the simulator uses, so the simulator and the emulated
runtime share one cost model and can be checked against each other (`dynaresize compare`):
- rollout: the rollout devices are the simulator's continuous-batching replicas
  (`costmodel.stages.StageModel.replica_detail`): sample i of the step (prompt-major order) goes to
  replica i mod R/tp; a replica's time is its decode steps' weight reads plus its samples' KV
  reads, compute and prefill, with their *emulated* lengths: `workload.batch_for_step` of
  `rollout.length_workload` (a named workload at its own cap, or a trace file's lengths and
  prompts; driver/job.py calls the same `workload.lengths_for_step` at `rollout.max_new_tokens` for
  the real, few-token responses);
- training: `StageModel.train(step, num_train)` (6N FLOPs per token plus attention and the
  old-log-prob pass, over the training devices, plus the fixed exposed time);
- weight sync: `costmodel.costs.sync_s` (alpha + model bytes / bandwidth; with delta sync the
  bytes of a step's changed values at the change fraction the run measures, `sync_changed`);
- each resize op by name (cluster/resize_ops.py HANDLERS): `costmodel.costs.op_cost`;
- with `train.lora`, the emulated model trains the same adapter (`costs.lora_of`): its moves'
  shards, its syncs and its training FLOPs are the LoRA job's.
Bounds follow the simulator's rule (`Scenario.bounds`): a rollout replica is the move unit and
the training state's memory floor is the least number of training devices.

Pure: no Ray, torch, I/O or clock, and no simulator: the cluster imports this module, so it
reads only the cost models (`costmodel`). Config objects are read duck-typed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dynaresize.costmodel.costs import (HARDWARE_PRESETS, MODEL_PRESETS, get_hardware, get_model, lora_of, op_cost,
                                        sync_mode_of)
from dynaresize.costmodel.costs import sync_s as costs_sync_s
from dynaresize.costmodel.costs import with_sync
from dynaresize.costmodel.stages import Batch, StageModel
from dynaresize.errors import ConfigError
from dynaresize.pipeline.dispatch import batch_position
from dynaresize.types import Bounds, StepReport
from dynaresize.workload import batch_for_step

DEFAULT_TIME_SCALE = 20.0  # a 7B step of ~165 emulated seconds lasts ~8 wall seconds
UNPACED = ("none", "off")  # `--emulate none`: the run is not paced


@dataclass(frozen=True, kw_only=True)
class Target:
    """An emulated accelerator and model, e.g. `h100:7b`."""

    accelerator: str
    model: str

    @property
    def spec(self) -> str:
        return f"{self.accelerator}:{self.model}"


def parse(text: str) -> Target:
    """"h100:7b" -> Target; a ValueError says what is wrong (the caller names the field)."""
    accel, sep, model = str(text).strip().lower().partition(":")
    if not sep or not accel or not model:
        raise ValueError(f"expected ACCEL:MODEL, e.g. h100:7b (accelerators: {', '.join(HARDWARE_PRESETS)}; "
                         f"models: {', '.join(MODEL_PRESETS)}), or null for unpaced devices")
    if accel not in HARDWARE_PRESETS:
        raise ValueError(f"unknown accelerator {accel!r} (known: {', '.join(HARDWARE_PRESETS)})")
    if model not in MODEL_PRESETS:
        raise ValueError(f"unknown model {model!r} (known: {', '.join(MODEL_PRESETS)})")
    return Target(accelerator=accel, model=model)


def time_scale_of(cluster: Any) -> float:
    """The run's emulated seconds per wall second (1 when nothing is emulated)."""
    if not getattr(cluster, "emulate", None):
        return 1.0
    return float(cluster.time_scale) if cluster.time_scale is not None else DEFAULT_TIME_SCALE


def emulated_bounds(target: Target, policy: Any, num_devices: int, cfg: Any = None) -> Bounds:
    """The simulator's bounds (`costmodel.scenarios.Scenario.bounds`) under the user's policy limits:
    a rollout replica (tp devices) is the least rollout pool and the move unit, the
    training state's memory floor (of run config `cfg`'s LoRA adapter, when it has one) the least
    training pool, and `policy.allowed_rollout` (when set) the only splits."""
    from dynaresize.costmodel.costs import min_train_devices

    model, hw = get_model(target.model), get_hardware(target.accelerator)
    model = model if cfg is None else lora_of(model, cfg)
    return replica_bounds(model.rollout_tp, policy, num_devices,
                          min_train=max(policy.min_train, min_train_devices(model, hw)))


def replica_bounds(tp: int, policy: Any, num_devices: int, *, min_train: int) -> Bounds:
    """Bounds where a rollout replica spans `tp` devices: the move unit is the policy's rounded up
    to whole replicas, and the least rollout pool is one move unit at least."""
    unit = -(-max(policy.move_unit, tp) // tp) * tp
    min_rollout = -(-max(policy.min_rollout, tp) // unit) * unit
    return Bounds(num_devices=num_devices, min_rollout=min_rollout, min_train=min_train, move_unit=unit,
                  allowed_rollout=tuple(getattr(policy, "allowed_rollout", ())))


def run_bounds(cfg: Any) -> Bounds:
    """The bounds of a run: the policy's limits, rounded to whole rollout replicas
    (`rollout.tensor_parallel` devices each) and raised to an emulated accelerator's. Emulated,
    a replica is the emulated model's (its TP size, the move unit) and the tiny real engines
    behind it are TP1 ones, each paced for its part of the replica's share."""
    c, p = cfg.cluster, cfg.policy
    k = int(getattr(cfg.rollout, "tensor_parallel", 1))
    if getattr(c, "emulate", None):
        target = parse(c.emulate)
        if k != 1:
            tp = get_model(target.model).rollout_tp
            raise ConfigError([f"rollout.tensor_parallel={k}: emulated runs pace TP1 engines as the emulated "
                               f"model's replicas ({target.model}: TP{tp}, moved {tp} devices at a time); "
                               "set 1 with cluster.emulate"])
        return emulated_bounds(target, p, c.devices, cfg)
    return replica_bounds(k, p, c.devices, min_train=p.min_train)


class Emulator:
    """The emulated durations of one job (see the module docstring). Seconds are emulated."""

    def __init__(self, target: Target, *, workload: str, prompts_per_step: int, samples_per_prompt: int,
                 seed: int, num_steps: int, horizon_steps: int = 0) -> None:
        self.target = target
        self.model = get_model(target.model)
        self.hw = get_hardware(target.accelerator)
        self.workload = workload
        self.prompts_per_step = int(prompts_per_step)
        self.samples_per_prompt = int(samples_per_prompt)
        self.seed = int(seed)
        self.num_steps = int(num_steps)
        self.horizon_steps = int(horizon_steps)  # rollout.length_horizon_steps (0: the workload's own)
        self.stages = StageModel(self.model, self.batch, self.hw, batch_cache=8)

    @classmethod
    def from_config(cls, cfg: Any) -> "Emulator | None":
        """The emulator of a run config, or None when the run is not emulated."""
        if not cfg.cluster.emulate:
            return None
        rc = cfg.rollout
        em = cls(parse(cfg.cluster.emulate), workload=rc.length_workload, prompts_per_step=rc.prompts_per_step,
                 samples_per_prompt=rc.samples_per_prompt, seed=cfg.seed, num_steps=cfg.steps,
                 horizon_steps=rc.length_horizon_steps)
        em.model = lora_of(em.model, cfg)
        em.stages = StageModel(em.model, em.batch, em.hw, batch_cache=8)
        em.sync_changed(sync_mode_of(cfg), None)
        return em

    def sync_changed(self, mode: str, changed_fraction: float | None) -> None:
        """Weight syncs paced as `mode` sends them (`costs.with_sync`), at `changed_fraction`
        (None: the model's; the runtime passes the one its delta syncs measure, cluster/stages.py);
        with delta sync a joining engine's full sync is in its move (`op_s("load_weights")`)."""
        self.model = with_sync(self.model, mode, changed_fraction)
        self.stages.model, self.stages.sync_s = self.model, costs_sync_s(self.model)

    # ------------------------------------------------------------------ the workload

    def batch(self, step: int) -> Batch:
        """The step's samples at their emulated lengths, in prompt-major order (sample (p, s) is
        entry p * S + s): the same workload call as driver/job.py's synthetic lengths
        (`workload.lengths_for_step`), at the workload's own lengths instead of
        `rollout.max_new_tokens`."""
        return batch_for_step(self.workload, step, self.prompts_per_step * self.samples_per_prompt, self.seed,
                              samples_per_prompt=self.samples_per_prompt, horizon_steps=self.horizon_steps)

    def lengths(self, step: int) -> np.ndarray:
        """Emulated response lengths of `step`, shape (prompts, samples per prompt)."""
        return self.batch(step).response_tokens.reshape(self.prompts_per_step, self.samples_per_prompt)

    def sample_index(self, sample_id: tuple[int, int, int]) -> int:
        """Position of sample (step, prompt position, sample) in its step's batch: the runtime's
        dispatch positions (`pipeline.dispatch.batch_position`), one definition for both."""
        return batch_position(sample_id, self.samples_per_prompt)

    # ------------------------------------------------------------------ durations

    def rollout_plan(self, step: int, num_rollout: int) -> list[tuple[tuple[int, ...], float]]:
        """Per rollout device slot (0..num_rollout-1): the batch positions it serves and its
        emulated busy seconds. Replica j = slots j*tp .. j*tp+tp-1 serves positions i with
        i mod (num_rollout // tp) == j, split over its devices; every device of a replica is busy
        for the replica's time. Slots beyond whole replicas serve nothing.

        Dynamic sampling (a workload with a filtered share, `algorithm.filter_metric=workload`):
        the step's generation batches are sent one after another, so there is one such entry per
        (generation batch, slot), each batch timed alone as the simulator times it
        (`StageModel` rolls a step's batches out one after another; `_gen_plan`)."""
        batch = self.batch(step)
        if batch.num_gen_batches > 1:
            plan: list[tuple[tuple[int, ...], float]] = []
            for b in range(batch.num_gen_batches):
                first = int(np.flatnonzero(batch.gen_batch == b)[0])
                part = self._gen_plan(step, b, num_rollout)
                plan += [(tuple(first + i for i in positions), t) for positions, t in part]
            return plan
        times, _, _ = self.stages.replica_detail(step, num_rollout)
        return self._plan(times, batch.num_samples, num_rollout)

    def _plan(self, times: np.ndarray, n: int, num_rollout: int) -> list[tuple[tuple[int, ...], float]]:
        tp = self.model.rollout_tp
        n_rep = max(1, num_rollout // tp)
        plan: list[tuple[tuple[int, ...], float]] = []
        for slot in range(num_rollout):
            j, part = divmod(slot, tp)
            if j >= n_rep:
                plan.append(((), 0.0))
                continue
            mine = range(j, n, n_rep)
            plan.append((tuple(mine[part::tp]), float(times[j])))
        return plan

    def _gen_plan(self, step: int, gen_batch: int, num_rollout: int) -> list[tuple[tuple[int, ...], float]]:
        """`rollout_plan` of one generation batch alone (positions within it). Batch b starts at
        position b*n of the step (n samples per batch), so the runtime's replica j of it
        (positions p = j mod R) is the batch's own replica (j - b*n) mod R: the same sets of
        samples, so the same times."""
        batch = self.batch(step)
        mask = batch.gen_batch == gen_batch
        part = Batch(batch.response_tokens[mask], batch.prompt_tokens[mask])
        stages = StageModel(self.model, lambda _b: part, self.hw, batch_cache=1)
        times, _, _ = stages.replica_detail(0, num_rollout)
        return self._plan(times, part.num_samples, num_rollout)

    def stream_shares(self, step: int, num_rollout: int) -> list[tuple[int, int]]:
        """The streaming pipeline's shares of step `step` as `sim.stream` cuts them: ceil(B /
        replicas) consecutive batch positions [lo, hi) each, at most what a replica admits."""
        n = self.batch(step).num_samples
        share = max(1, min(self.stages.slots(step), -(-n // max(1, num_rollout // self.model.rollout_tp))))
        return [(lo, min(lo + share, n)) for lo in range(0, n, share)]

    def stream_plan(self, step: int, num_rollout: int) -> list[tuple[tuple[int, ...], float, float, int]]:
        """`stream_shares` as dispatch items (positions, time, body time, longest position):
        each timed on one replica (`StageModel.chunk`: its longest request ends at `time`, the
        others by the end of its body); a replica's tp devices split its share."""
        tp, out, lengths = self.model.rollout_tp, [], self.lengths_flat(step)
        for lo, hi in self.stream_shares(step, num_rollout):
            ch, top = self.stages.chunk(step, lo, hi), lo + int(np.argmax(lengths[lo:hi]))
            out += [(tuple(range(lo, hi))[part::tp], ch.time_s, ch.body_s, top) for part in range(tp)]
        return out

    def moved_share(self, step: int, positions: list[int], *, share: list[int] | None = None,
                    elapsed_s: float = 0.0) -> tuple[float, float, int]:
        """(time, body time, longest position) of requests moved to another replica, as the
        simulator's migration times them (`StageModel.chunk_at`): from their first token, or,
        given the `share` they were part of and how long it had decoded (`elapsed_s`, partial
        rollout), resumed with the prefix they had made by then (`StageModel.tokens_after`)."""
        done = None
        if share is not None:
            made = dict(zip(share, self.stages.tokens_after(step, share, elapsed_s)))
            done = [int(made.get(i, 0)) for i in positions]
        ch = self.stages.chunk_at(step, positions, done)
        lengths = self.lengths_flat(step)
        left = {i: lengths[i] - (done[k] if done else 0) for k, i in enumerate(positions)}
        top = max(positions, key=lambda i: (left[i], -i))
        return ch.time_s, ch.body_s, top

    def lengths_flat(self, step: int) -> np.ndarray:
        """Emulated response lengths of `step` in batch order (the stage model's cached batch)."""
        return self.stages.batch(step).response_tokens

    def rollout_s(self, step: int, num_rollout: int) -> float:
        return self.stages.rollout(step, num_rollout).time_s

    def rollout_floor_s(self, step: int) -> float:
        """The step's longest response decoded alone: what no number of devices removes."""
        return self.stages.data(step).floor_s

    def train_s(self, step: int, num_train: int) -> float:
        return self.stages.train(step, num_train).time_s

    def train_part_s(self, step: int, positions: list[int], num_train: int, *, last: bool) -> float:
        """Training of the samples at `positions` of step `step`'s batch (their compute over
        `num_train` devices), plus the fixed exposed time when `last`: a step's parts add up to
        `train_s` (the compute is a sum over sequences, `StageModel.train_chunk_device_s`)."""
        dev_s = sum(self.stages.train_chunk_device_s(step, i, i + 1) for i in positions)
        return dev_s / max(num_train, 1) + (self.train_fixed_s if last else 0.0)

    @property
    def train_fixed_s(self) -> float:
        return self.model.train_comm_s

    @property
    def sync_s(self) -> float:
        return self.stages.sync_s

    def op_s(self, name: str, *, num_train_before: int, num_train_after: int, num_moving: int) -> float:
        """One resize op on one moving device (the devices of an op run it in parallel)."""
        return op_cost(name, self.model, num_train_before=num_train_before, num_train_after=num_train_after,
                       num_moving=num_moving, hw=self.hw)[0]

    # ------------------------------------------------------------------ what the runtime reports

    def report(self, report: StepReport, rollout_step: int | None) -> StepReport:
        """A step report (already in emulated seconds) with what an engine on the emulated
        hardware knows: the floor of the rollout it measured (its longest response at its
        batch-1 pace) and the training stage's fixed exposed time; under streaming (the report
        counts engine calls) also the shares' serial part, the engine's admission limit and the
        emulated response lengths, which the throughput model reads; one-step-off, the emulated
        training demand of the batch trained and of the next one."""
        floor = self.rollout_floor_s(rollout_step) if rollout_step is not None else 0.0
        extra: dict = {}
        if report.train_tokens > 0:  # one-step-off: the emulated batches' training demand, as the simulator's
            extra = {"train_tokens": self.stages.seq_tokens(report.step),
                     "next_train_tokens": self.stages.seq_tokens(rollout_step) if rollout_step is not None else 0}
        if report.rollout_chunks > 0 and rollout_step is not None:  # streaming: the shares' serial part
            serial = sum(self.stages.chunk(rollout_step, lo, hi).serial_s
                         for lo, hi in self.stream_shares(rollout_step, report.num_rollout))
            extra = {"rollout_serial_s": float(serial) * self.model.rollout_tp,
                     "rollout_slots": self.stages.slots(rollout_step),
                     "response_lengths": tuple(int(x) for x in self.batch(rollout_step).response_tokens)}
        return replace(report, rollout_floor_s=min(floor, report.rollout_s) if report.rollout_s > 0 else 0.0,
                       train_fixed_s=min(self.train_fixed_s, report.train_s), **extra)

    # ------------------------------------------------------------------ the same job in the simulator

    def scenario(self, num_devices: int):
        """The simulator's scenario of this job: same batches, devices, model and hardware."""
        from dynaresize.costmodel.scenarios import Scenario

        return Scenario(name=self.workload, num_devices=num_devices, num_steps=self.num_steps, model=self.model,
                        seed=self.seed, prompts_per_step=self.prompts_per_step,
                        samples_per_prompt=self.samples_per_prompt, batch_of=self.batch, hardware=self.hw)


def covered_s(intervals) -> float:
    """Length of the union of (start, end) intervals: time during which any of them ran."""
    total, end = 0.0, None
    for a, b in sorted((float(a), float(b)) for a, b in intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def span_s(intervals) -> float:
    """max(end) - min(start) of (start, end) pairs; 0 for none."""
    pairs = [(float(a), float(b)) for a, b in intervals]
    return max(b for _, b in pairs) - min(a for a, _ in pairs) if pairs else 0.0
