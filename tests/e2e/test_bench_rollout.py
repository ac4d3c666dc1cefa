"""`dynaresize bench rollout`: the runtime's rollout path and one vLLM engine's own generate over
the same requests (forced lengths: the same tokens), side by side in one run. Its ratio is a
benchmark figure (docs/rollout.md), not asserted here; what is asserted is that both sides did
the same work and the result says so."""

from __future__ import annotations

import json

import pytest

from dynaresize.commands.bench_rollout import runtime_rate

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.vllm]  # ~80 s: a 3-step vLLM run and an engine


def test_bench_rollout_compares_the_same_tokens(tmp_path, capsys):
    from dynaresize.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "rollout", "--steps", "3", "--prompts", "8", "--max-new-tokens", "32", "--out", str(out)]) == 0
    result = json.loads((out / "bench-rollout.json").read_text())
    tokens, seconds = runtime_rate(out / "run" / "records.jsonl")
    assert result["tokens"] == tokens > 0 and result["runtime_s"] == pytest.approx(seconds)
    assert result["requests_per_step"] == 32 and result["steps_measured"] == 2
    assert result["ratio"] == pytest.approx(result["runtime_tokens_per_s"] / result["engine_tokens_per_s"])
    assert f"ratio {result['ratio']:.2f}" in capsys.readouterr().out
