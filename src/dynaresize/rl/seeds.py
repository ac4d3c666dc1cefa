"""Per-sample seeds and ids: functions of the sample id only.

Invariant: `sample_seed(run_seed, step, p, s)` depends on nothing but its four arguments (a
sha256 of them), never on the device, worker, batch or process that generates the sample, so a
sample re-issued anywhere is sampled with the same noise. Stable across Python versions and
processes (unlike `hash()`).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # fits torch.Generator.manual_seed and a signed int64


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The sampling seed of sample (step, prompt_index, sample_index) in a run seeded `run_seed`."""
    key = f"dynaresize-sample:{int(run_seed)}:{int(step)}:{int(prompt_index)}:{int(sample_index)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> (64 - SEED_BITS)


def derived_seed(run_seed: int, *parts: object) -> int:
    """A seed for any other purpose (for example prompt order), named by `parts`."""
    key = "dynaresize:" + ":".join([str(int(run_seed)), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> (64 - SEED_BITS)


def sample_id_str(step: int, prompt_index: int, sample_index: int) -> str:
    """The ledger spelling of a sample id: "STEP-PROMPT-SAMPLE"."""
    return f"{int(step)}-{int(prompt_index)}-{int(sample_index)}"
