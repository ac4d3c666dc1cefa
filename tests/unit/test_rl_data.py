"""Prompt files, per-step prompt choice, and per-sample seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from dynaresize.errors import DataError, UserError
from dynaresize.rl.data import load_prompts, prompt_order, prompts_for_step, reward_fields
from dynaresize.rl.seeds import sample_id_str, sample_seed


def _write(tmp_path, text: str, name: str = "p.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_prompts_keeps_fields_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, '{"prompt": "2+2=", "answer": 4}\n\n  \n{"prompt": "hi", "tags": ["a"]}\n')
    recs = load_prompts(path)
    assert recs == [{"prompt": "2+2=", "answer": 4}, {"prompt": "hi", "tags": ["a"]}]
    assert reward_fields(recs[0]) == {"answer": 4}


@pytest.mark.parametrize("text, where, what", [
    ("", "p.jsonl", "no prompts"),
    ("\n \n", "p.jsonl", "no prompts"),
    ('{"prompt": "a"}\n{"prompt": "b",\n', "p.jsonl:2", "bad JSON"),
    ('{"prompt": "a"}\n\n["prompt"]\n', "p.jsonl:3", "expected a JSON object"),
    ('{"question": "a"}\n', "p.jsonl:1", 'missing "prompt" field (fields: question)'),
    ('{"prompt": "a"}\n{"prompt": 3}\n', "p.jsonl:2", '"prompt" must be a string, got int'),
    ('{"prompt": "  "}\n', "p.jsonl:1", '"prompt" is empty'),
])
def test_load_prompts_errors_name_file_and_line(tmp_path, text, where, what):
    path = _write(tmp_path, text)
    with pytest.raises(DataError) as exc:
        load_prompts(path)
    msg = str(exc.value)
    assert isinstance(exc.value, UserError)
    assert "\n" not in msg
    assert msg.startswith(str(tmp_path / where) + ":" if ":" in where else str(tmp_path / where))
    assert what in msg


def test_load_prompts_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_prompts_for_step_deterministic_and_epoch_complete():
    prompts = [{"prompt": f"p{i}"} for i in range(10)]
    a = prompts_for_step(prompts, 3, 4, seed=7)
    assert a == prompts_for_step(prompts, 3, 4, seed=7)
    assert [j for j, _ in a] == [0, 1, 2, 3]
    assert prompts_for_step(prompts, 3, 4, seed=8) != a
    # Read as a stream, each epoch of 10 uses every prompt once (steps of 5 tile it exactly).
    order = [i for step in range(6) for i in prompt_order(10, step, 5, seed=7)]
    for epoch in range(3):
        assert sorted(order[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    # Epochs are shuffled differently.
    assert order[:10] != order[10:20]
    # A step longer than the list still gets num_prompts prompts with unique positions.
    big = prompts_for_step(prompts[:3], 0, 7, seed=1)
    assert [j for j, _ in big] == list(range(7))
    assert max(Counter(r["prompt"] for _, r in big).values()) == 3


def test_sample_seeds_stable_distinct_and_process_independent():
    ids = [(run, step, p, s) for run in (0, 1) for step in range(3) for p in range(4) for s in range(4)]
    seeds = [sample_seed(*i) for i in ids]
    assert len(set(seeds)) == len(ids)
    assert all(0 <= x < 2 ** 63 for x in seeds)
    # Another interpreter (other hash seed) computes the same seed.
    code = "from dynaresize.rl.seeds import sample_seed; print(sample_seed(1, 2, 3, 0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert int(out.stdout) == sample_seed(1, 2, 3, 0)
    assert sample_id_str(12, 3, 0) == "12-3-0"


def test_json_roundtrip_of_records(tmp_path):
    rec = {"prompt": "unicode: é ✓", "meta": {"k": [1, 2]}}
    path = _write(tmp_path, json.dumps(rec, ensure_ascii=False) + "\n")
    assert load_prompts(path) == [rec]


def test_synthetic_lengths_keyed_by_absolute_step_and_trace_files(tmp_path):
    """A run's forced lengths never depend on how many steps it was started for (a resume with
    more steps continues the same job), and a trace file drives them by its `step` values."""
    import json

    from dynaresize.config_load import build_config
    from dynaresize.driver.job import Job

    def forced(steps, workload="longtail-drift", step=5):
        cfg = build_config({"steps": steps, "rollout": {"synthetic_lengths": True, "length_workload": workload,
                                                        "prompts_per_step": 2, "samples_per_prompt": 3,
                                                        "max_new_tokens": 64}})
        return [[r.forced_length for r in g] for g in Job(cfg).requests(step)]

    assert forced(10) == forced(50) and forced(10) != forced(10, step=6)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"step": s, "response_tokens": [10 * (s + 1) + i for i in range(6)]})
                               for s in range(8)) + "\n")
    got = forced(10, str(trace), step=2)
    # scaled by max_new_tokens / the trace's longest response (85), rounded up
    assert [x for g in got for x in g] == [-(-(30 + i) * 64 // 85) for i in range(6)]
