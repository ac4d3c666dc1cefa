"""Workloads shared by the simulator and the runtime: response-length models and traces.

The one call a runtime needs is `lengths_for_step(workload, step, n, seed)`: the response
lengths of the `n` samples of ABSOLUTE step `step`, in sample order (prompt-major: sample
`i` is sample `i % samples_per_prompt` of prompt `i // samples_per_prompt`). `workload` is a
named model (`WORKLOADS`: longtail-drift, longtail-stationary, short-tail, cap-raise, demo) or
the path of a JSONL trace (`workload.trace`). The answer never depends on how many steps the
run was started for, nor on device counts: a resume with more steps continues the same job.

Pure except reading a trace file (cached by path, size and modification time).
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from dynaresize.errors import ConfigError, TraceError
from dynaresize.workload.lengths import (WORKLOADS, WorkloadSpec, _key, _name_id, _uniform, get_workload, multi_turn,
                                        sample_lengths, sample_lengths_array)
from dynaresize.workload.trace import Batch, load_trace, load_trace_steps

SAMPLES_PER_PROMPT = 16  # the simulator's GRPO group size (RollPacker's 8-16 samples per prompt)


def named_spec(workload: str, horizon_steps: int | None = None) -> WorkloadSpec:
    """A named workload, with its time constants stretched or compressed to `horizon_steps`
    (None or 0: its own `horizon_steps`). The horizon is part of the job, like the workload's
    name: it never follows the run's number of steps."""
    spec = get_workload(workload)
    return replace(spec, horizon_steps=int(horizon_steps)) if horizon_steps else spec


def lengths_for_step(workload: str, step: int, n: int, seed: int, *, samples_per_prompt: int = SAMPLES_PER_PROMPT,
                     max_tokens: int | None = None, horizon_steps: int | None = None) -> list[int]:
    """Response lengths (tokens) of the `n` samples of absolute step `step`.

    - A named workload: the model of `workload.lengths` with its cap rescaled to `max_tokens`
      (default: the workload's own cap, `cap_tokens`) and its horizon set to `horizon_steps`
      (default: its own, `named_spec`); `n` need not be a multiple of
      `samples_per_prompt` (the last prompt is cut short; every length stays what it would be
      in a larger batch).
    - A trace file: the first `n` responses of the line whose `step` equals `step`; with
      `max_tokens`, scaled by `max_tokens / (longest response in the trace)` and rounded up,
      so the trace's shape fits a smaller cap. `seed` does not change a trace's lengths.
    Errors: an unknown name that is not a file is a ConfigError; a trace without that step, or
    with fewer than `n` responses in it, a TraceError.
    """
    if n < 1 or samples_per_prompt < 1 or step < 0:
        raise ValueError(f"need n >= 1, samples_per_prompt >= 1, step >= 0 (got {n}, {samples_per_prompt}, {step})")
    if workload in WORKLOADS:
        spec = named_spec(workload, horizon_steps)
        prompts = -(-n // samples_per_prompt)
        cap = spec.cap_tokens if max_tokens is None else int(max_tokens)
        arr = sample_lengths_array(spec, step, prompts, samples_per_prompt, cap, seed)
        return arr.ravel()[:n].tolist()
    path = Path(workload)
    if not path.is_file():
        raise ConfigError([f"workload={workload!r}: neither a known workload ({', '.join(WORKLOADS)}) "
                           "nor a trace file"])
    if horizon_steps:
        raise ConfigError([f"horizon_steps={horizon_steps}: only a named workload has a horizon "
                           f"(a trace's lengths are its own; got the trace {workload!r})"])
    st = os.stat(path)
    by_step, longest = _trace_index(str(path.resolve()), st.st_size, st.st_mtime_ns)
    batch = by_step.get(int(step))
    if batch is None:
        raise TraceError(f"{path}: no line for step {step} (the trace has steps {min(by_step)}..{max(by_step)})")
    if batch.num_samples < n:
        raise TraceError(f"{path}: step {step} has {batch.num_samples} responses, {n} asked for")
    lengths = batch.response_tokens[:n]
    if max_tokens is not None:
        scaled = np.ceil(lengths * (int(max_tokens) / max(longest, 1)))
        lengths = np.clip(scaled, 1, int(max_tokens))
    return [int(x) for x in lengths]


def batch_for_step(workload: str, step: int, n: int, seed: int, *,
                   samples_per_prompt: int = SAMPLES_PER_PROMPT, horizon_steps: int | None = None,
                   filter_shares: tuple[float, ...] = ()) -> Batch:
    """Step `step`'s first `n` samples at the workload's own lengths, with their prompt lengths:
    a named workload's `prompt_tokens` for every sample, a trace's own prompt lengths. The
    simulator and the emulated runtime size their work from this one batch. A multi-turn
    workload's sample is a trajectory: its model tokens plus its observations' tokens, and its
    tool waits (`Batch.wait_s`, `lengths.multi_turn`). A workload with a filtered share (dynamic
    sampling) gives the step's generation batches (`_filtered_batch`), at `filter_shares` (a
    run's measured share per step, `workload.filter_runs`) when given."""
    if workload in WORKLOADS and named_spec(workload).filter_share(step) > 0:
        spec = replace(named_spec(workload, horizon_steps), filter_shares=tuple(filter_shares))
        return _filtered_batch(spec, step, n, seed, samples_per_prompt)
    lengths = np.asarray(lengths_for_step(workload, step, n, seed, samples_per_prompt=samples_per_prompt,
                                          horizon_steps=horizon_steps), dtype=np.int64)
    if workload in WORKLOADS:
        spec = WORKLOADS[workload]
        prompts = np.full(lengths.shape, spec.prompt_tokens, dtype=np.int64)
        if spec.max_turns > 1:  # a trajectory: its observations are in its context, its tool waits hold its slot
            turns, wait_s = multi_turn(spec, step, n, seed)
            return Batch(lengths + (turns - 1) * spec.obs_tokens, prompts, wait_s=wait_s)
    else:
        st = os.stat(workload)
        by_step, _ = _trace_index(str(Path(workload).resolve()), st.st_size, st.st_mtime_ns)
        prompts = by_step[int(step)].prompt_tokens[:n].astype(np.int64)
    return Batch(lengths, prompts)


def filtered_groups(spec: WorkloadSpec, step: int, gen_batch: int, num_prompts: int, seed: int) -> np.ndarray:
    """Which prompt groups of generation batch `gen_batch` of step `step` the workload filters out
    (bool, one per prompt of the batch: True = filtered), drawn with the workload's share at that
    step (`WorkloadSpec.filter_share`) by a counter-based hash of (seed, workload, step, batch,
    prompt): the simulator's model of dynamic sampling, and what a run with
    `algorithm.filter_metric = workload` filters by (driver/dynamic_sampling.py)."""
    ids = np.arange(int(num_prompts), dtype=np.uint64)
    return _uniform(_key(seed, _name_id(spec.name), 0xF1, step, gen_batch), ids) < spec.filter_share(step)


def filter_spec(workload: str, horizon_steps: int | None = None) -> WorkloadSpec | None:
    """The named workload with a filtered share (dynamic sampling) at `horizon_steps`, or None
    for a workload without one (or a trace)."""
    if workload not in WORKLOADS or not (WORKLOADS[workload].filter_share0 or WORKLOADS[workload].filter_share_end):
        return None
    return named_spec(workload, horizon_steps)


def _filtered_batch(spec: WorkloadSpec, step: int, n: int, seed: int, samples_per_prompt: int) -> Batch:
    """Step `step` under dynamic sampling: generation batches of `n` samples (their own lengths,
    batch b seeded by (seed, b)), each prompt group filtered with the workload's share at that
    step (`filtered_groups`), until n // samples_per_prompt groups are kept or `max_gen_batches`
    are generated; the first kept groups are trained."""
    prompts = -(-n // samples_per_prompt)
    lengths, gen, trained = [], [], []
    kept = 0
    for b in range(spec.max_gen_batches):
        seed_b = seed if b == 0 else _key(seed, 0x5EED, b) >> 1
        arr = sample_lengths_array(spec, step, prompts, samples_per_prompt, spec.cap_tokens, seed_b)
        out = filtered_groups(spec, step, b, prompts, seed)
        for p in range(prompts):
            take = not out[p] and kept < prompts
            kept += int(take)
            lengths.append(arr[p])
            trained.append(np.full(samples_per_prompt, take))
            gen.append(np.full(samples_per_prompt, b))
        if kept >= prompts:
            break
    resp = np.concatenate(lengths).astype(np.int64)
    return Batch(resp, np.full(resp.shape, spec.prompt_tokens, dtype=np.int64),
                 gen_batch=np.concatenate(gen).astype(np.int64), trained=np.concatenate(trained))


@lru_cache(maxsize=8)
def _trace_index(path: str, size: int, mtime_ns: int) -> tuple[dict[int, Batch], int]:
    steps = load_trace_steps(path)
    longest = max(int(b.response_tokens.max()) for _, b in steps)
    return dict(steps), longest


__all__ = ["WORKLOADS", "WorkloadSpec", "Batch", "get_workload", "sample_lengths", "sample_lengths_array",
           "lengths_for_step", "batch_for_step", "named_spec", "load_trace", "SAMPLES_PER_PROMPT", "filtered_groups",
           "filter_spec"]
