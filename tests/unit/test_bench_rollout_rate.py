"""`dynaresize bench rollout`'s runtime figure from a run's records (commands/bench_rollout.py)."""

import json

from dynaresize.commands.bench_rollout import runtime_rate


def test_runtime_rate_counts_each_windows_rolled_out_step(tmp_path):
    """Window k's rollout_s is step k + 1's rollout; a sample's last record is its state."""
    lines = [{"kind": "step", "step": 0, "rollout_s": 2.0}, {"kind": "step", "step": 1, "rollout_s": 3.0},
             {"kind": "step", "step": 2, "rollout_s": 0.0},
             {"kind": "sample", "sample_id": "0-0-0", "num_tokens": 99},  # step 0: rolled out before window 0
             {"kind": "sample", "sample_id": "1-0-0", "num_tokens": 10},
             {"kind": "sample", "sample_id": "1-0-1", "num_tokens": 4},
             {"kind": "sample", "sample_id": "2-0-0", "num_tokens": 7},
             {"kind": "sample", "sample_id": "2-0-0", "num_tokens": 7, "consumed_step": 2}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert runtime_rate(path) == (14 + 7, 5.0)
