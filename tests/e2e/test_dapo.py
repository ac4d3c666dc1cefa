"""End to end: DAPO as verl users run it (dynamic sampling, overlong shaping, clip-higher).

- `--preset dapo` (the math task, filtering and overlong shaping on, scripted moves each way)
  runs from the CLI: steps of two or more generation batches, filtered samples in the ledger
  with their reason and their overlong penalty, the ledger ok, a move each way.
- A deterministic run with filtering on and scripted moves each way equals the static run:
  the same generation batches, the same kept and filtered groups, the same tokens of every
  sample, parameters within 1e-6, one-step off and streaming (staleness 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from _runs import ray_local, records  # noqa: F401,E402  (the module's Ray)

from dynaresize.config_load import build_config, merge  # noqa: E402
from dynaresize.driver.run import run_job  # noqa: E402
from dynaresize.presets import preset  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.mark.slow  # ~1-2 min on 2 cores: vLLM engines and the math grader's reward workers
def test_dapo_preset_filters_groups_and_moves_each_way(ray_local, tmp_path, monkeypatch):
    from dynaresize.cli import main

    monkeypatch.setenv("DYNARESIZE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "dapo"
    assert main(["run", "--no-progress", "--preset", "dapo", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger_ok"], summary["ledger_problems"]
    assert summary["resizes_to_rollout"] >= 1 and summary["resizes_to_train"] >= 1, summary
    steps = records(out, "step")
    assert len(steps) == 6 and max(s["gen_batches"] for s in steps) >= 2
    assert all(s["groups_kept"] == 4 for s in steps)
    samples = records(out, "sample")
    filtered = [s for s in samples if (s["dropped"] or "").startswith("filtered")]
    assert sum(s["groups_filtered"] + s["groups_surplus"] for s in steps) * 4 == len(filtered) > 0
    assert len([s for s in samples if s["consumed_step"] is not None]) == 6 * 4 * 4
    for s in samples:  # the shaping, per sample: 0 up to 8 tokens, then -1/24 a token
        assert s["overlong_penalty"] == pytest.approx(min(0.0, -(s["num_tokens"] - 8) / 24))


def _cfg(policy: dict, staleness: int = 1):
    return build_config(merge(preset("cpu"), {
        "steps": 4, "deterministic": True,
        "cluster": {"devices": 3, "rollout_devices": 1},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 512},
        "rollout": {"engine": "hf", "prompts_per_step": 3, "samples_per_prompt": 4, "max_new_tokens": 8,
                    "synthetic_lengths": True, "length_workload": "dapo-qwen3-8b", "gen_prompts_per_step": 2},
        "algorithm": {"filter_groups": True, "filter_metric": "reward"},
        "reward": {"overlong_buffer_len": 6},
        "train": {"lr": 1e-2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "staleness": staleness},
        "policy": policy,
    }))


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoint" / "model.safetensors"))


@pytest.mark.slow  # two 4-step runs on 3 devices, ~1 min each staleness
@pytest.mark.parametrize("staleness", [1, 2])
def test_deterministic_run_with_filtering_and_moves_equals_the_static_run(ray_local, tmp_path, staleness):
    s1 = run_job(_cfg({"name": "scripted", "schedule": "1:2,3:1"}, staleness), tmp_path / "moved", progress=False)
    s2 = run_job(_cfg({"name": "static:1"}, staleness), tmp_path / "static", progress=False)
    assert s1["ledger_ok"] and s2["ledger_ok"], (s1["ledger_problems"], s2["ledger_problems"])
    assert s1["resizes_to_rollout"] == 1 and s1["resizes_to_train"] == 1 and s2["resizes"] == 0
    moved = sorted(records(tmp_path / "moved", "step"), key=lambda r: r["step"])
    static = sorted(records(tmp_path / "static", "step"), key=lambda r: r["step"])
    assert [r["num_rollout"] for r in moved] == [1, 2, 2, 1]
    fields = ("gen_batches", "groups_kept", "groups_filtered", "groups_surplus")
    assert [[r[f] for f in fields] for r in moved] == [[r[f] for f in fields] for r in static]
    assert max(r["gen_batches"] for r in moved) >= 2 and sum(r["groups_filtered"] for r in moved) > 0
    fate = lambda d: {r["sample_id"]: (r["token_sha1"], r["consumed_step"], r["dropped"], r["reward"])  # noqa: E731
                      for r in records(d, "sample")}
    assert fate(tmp_path / "moved") == fate(tmp_path / "static")
    a, b = _weights(tmp_path / "moved"), _weights(tmp_path / "static")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"\nDAPO filtering, staleness {staleness}: gen_batches {[r['gen_batches'] for r in moved]}, filtered "
          f"{[r['groups_filtered'] for r in moved]}; max |moved - static| parameter difference {worst:.3g}")
    assert worst <= 1e-6
    # a filtered step trains in one part (its kept groups are known only once filtered), also
    # streaming, where an unfiltered step trains in parts as its groups arrive: one span per
    # training device and step
    for d in ("moved", "static"):
        spans: dict = {}
        for r in records(tmp_path / d, "span"):
            if r["name"] == "train":
                spans[(r["step"], r["device"])] = spans.get((r["step"], r["device"]), 0) + 1
        assert spans and set(spans.values()) == {1}, spans
