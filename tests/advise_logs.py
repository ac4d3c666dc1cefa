"""Generate verl-format logs of a job whose stage models are known, for the `advise` tests.

The truth: a 7B preset with its decode efficiency, decode/prefill MFU, training MFU and fixed
training time changed to values advise does not start from (`TRUTH`), on H100s, with the
response lengths of a named workload (`longtail-drift`: the mean grows ~2.5x over the run;
`longtail-stationary`: it does not). Each logged step's stage times are the simulator's stage
models on that step's batch at the logged split; the step time is the one-step-off pipeline's
max(rollout, training) + the weight sync. The logged split is the one that balances the two
fastest one-step-off split over the first `PILOT_STEPS` steps (what a user tunes in a pilot run).

Written as a verl console log (with Ray's `(TaskRunner pid=...)` prefix and a printed config),
a W&B history CSV, and a TensorBoard event directory (tensorboardX), all of the same numbers.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dynaresize.costmodel.costs import get_hardware, get_model, sync_s
from dynaresize.costmodel.stages import StageModel
from dynaresize.workload import batch_for_step, get_workload

PILOT_STEPS = 5
TRUTH = dict(decode_eff=2.2, mfu_decode=0.35, mfu_prefill=0.35, mfu_train=0.3, train_comm_s=2.0)


@dataclass
class GeneratedJob:
    rows: list[dict]
    rollout_devices: int
    devices: int
    prompts: int
    samples_per_prompt: int
    true_rollout_s: np.ndarray
    true_train_s: np.ndarray
    truth: object  # the ModelPreset
    batches: list


def generate(workload: str, *, steps: int = 60, devices: int = 32, prompts: int = 256, samples_per_prompt: int = 16,
             seed: int = 0) -> GeneratedJob:
    truth = replace(get_model("7b"), **TRUTH)
    hw = get_hardware("h100")
    n = prompts * samples_per_prompt
    batches = [batch_for_step(workload, k, n, seed, samples_per_prompt=samples_per_prompt, horizon_steps=steps)
               for k in range(steps)]
    sm = StageModel(truth, lambda b: batches[b], hw, batch_cache=steps)
    first = range(PILOT_STEPS)
    R = min(range(1, devices - 1), key=lambda r: np.mean([max(sm.rollout(k, r).time_s, sm.train(k, devices - r).time_s)
                                                          for k in first]))
    roll = np.array([sm.rollout(k, R).time_s for k in range(steps)])
    train = np.array([sm.train(k, devices - R).time_s for k in range(steps)])
    sync = sync_s(truth)
    cap = get_workload(workload).cap_tokens
    rows = []
    for k, b in enumerate(batches):
        L = b.response_tokens
        rows.append({"step": k + 1, "timing_s/gen": roll[k], "timing_s/old_log_prob": 0.25 * train[k],
                     "timing_s/update_actor": 0.75 * train[k], "timing_s/update_weights": sync,
                     "timing_s/step": max(roll[k], train[k]) + sync, "response_length/mean": float(L.mean()),
                     "response_length/max": float(L.max()), "response_length/min": float(L.min()),
                     "response_length/clip_ratio": float(np.mean(L >= cap)),
                     "prompt_length/mean": float(b.prompt_tokens.mean()), "actor/pg_loss": 0.01,
                     "critic/score/mean": 0.5})
    return GeneratedJob(rows=rows, rollout_devices=R, devices=devices, prompts=prompts,
                        samples_per_prompt=samples_per_prompt, true_rollout_s=roll, true_train_s=train, truth=truth,
                        batches=batches)


def write_console(job: GeneratedJob, path: Path, *, with_config: bool = True) -> Path:
    lines = []
    if with_config:
        lines.append("{'actor_rollout_ref': {'rollout': {'name': 'vllm', 'n': %d, 'temperature': 1.0}}, "
                     "'data': {'train_batch_size': %d, 'max_prompt_length': 512}}" % (job.samples_per_prompt,
                                                                                      job.prompts))
    lines.append("(TaskRunner pid=4242) Training Progress: 0%|          | 0/60")
    for row in job.rows:
        pairs = " - ".join(f"{k}:{v:.6g}" if isinstance(v, float) else f"{k}:{v}" for k, v in row.items()
                           if k != "step")
        lines.append(f"(TaskRunner pid=4242) step:{row['step']} - {pairs}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_csv(job: GeneratedJob, path: Path) -> Path:
    keys = [k for k in job.rows[0] if k != "step"]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["_step", "_runtime", *keys])
        for i, row in enumerate(job.rows):
            w.writerow([row["step"], 10.0 * i, *[row[k] for k in keys]])
    return path


def write_tensorboard(job: GeneratedJob, directory: Path) -> Path:
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(directory)) as w:
        for row in job.rows:
            for k, v in row.items():
                if k != "step":
                    w.add_scalar(k, v, row["step"])
    return directory
