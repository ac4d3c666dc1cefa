"""Write the three held-out traces that docs/pipeline.md reports separately.

They come from the workload model of `dynaresize.workload.lengths` with parameters that no
named workload uses and that were never used to tune a policy (the policies were tuned on the
named workloads only):

- holdout-shrink: the median falls by half over the run (DeepScaleR's early shortening under
  an 8k cap, docs/references.md 2.3), sigma 1.1, runaway 0.5% falling with the median, cap 16k;
- holdout-heavy: a heavier tail at a fixed median (sigma 1.3, runaway 1%), cap 32k;
- holdout-steps: the cap raised twice, 4k -> 8k -> 16k at steps 100 and 200, the median doubling.

Usage: python scripts/holdout_traces.py OUT_DIR [--steps 300] [--samples 2048] [--seed 7]
Each trace is OUT_DIR/<name>.jsonl (one line per step, `dynaresize simulate --trace`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from dynaresize.workload.lengths import WorkloadSpec, sample_lengths_array
from dynaresize.workload.trace import Batch, write_trace

HOLDOUT = {
    "holdout-shrink": WorkloadSpec(name="holdout-shrink", mu0=math.log(3000.0), sigma=1.1, drift=-math.log(2.0),
                                   tau_frac=0.4, runaway0=0.005),
    "holdout-heavy": WorkloadSpec(name="holdout-heavy", mu0=math.log(1000.0), sigma=1.3, runaway0=0.01,
                                  runaway_gain=0.0, cap_tokens=32768),
    "holdout-steps": WorkloadSpec(name="holdout-steps", mu0=math.log(1000.0), drift=math.log(2.0), tau_frac=0.5,
                                  runaway0=0.004, cap_schedule=((0.0, 0.25), (1 / 3, 0.5), (2 / 3, 1.0))),
}
SAMPLES_PER_PROMPT = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--samples", type=int, default=2048, help="samples per step (64 devices x 32)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = -(-args.samples // SAMPLES_PER_PROMPT)
    for name, spec in HOLDOUT.items():
        batches = []
        for k in range(args.steps):
            lengths = sample_lengths_array(spec, k, prompts, SAMPLES_PER_PROMPT, spec.cap_tokens, args.seed)
            lengths = lengths.ravel()[: args.samples]
            batches.append(Batch(lengths, np.full(lengths.shape, spec.prompt_tokens, dtype=np.int64)))
        path = args.out / f"{name}.jsonl"
        write_trace(path, batches)
        longest = max(int(b.response_tokens.max()) for b in batches)
        print(f"wrote {path}: {args.steps} steps x {args.samples} samples, longest {longest} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
