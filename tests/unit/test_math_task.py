"""The built-in math task `arith` (rl/math_task.py): seeded problems with exact answers, written
once into verl's parquet schema and read back by the dataset loader; the `math` preset."""

from __future__ import annotations

import re
from fractions import Fraction

from dynaresize.config import TaskConfig
from dynaresize.config_load import build_config
from dynaresize.presets import preset
from dynaresize.rl import math_task
from dynaresize.rl.dataset import load_dataset, schema
from dynaresize.rl.tasks import MATH_REWARD, load_task

# Each template's numbers, read back from the question, give its answer independently.
SOLVE = [
    (r"has (\d+) \w+\. \w+ gets (\d+) more and gives (\d+)", lambda a, b, c: a + b - c),
    (r"A box holds (\d+) \w+\. How many \w+ are in (\d+) boxes", lambda a, b: a * b),
    (r"shares (\d+) \w+ equally among (\d+) friends", lambda a, b: Fraction(a, b)),
    (r"costs (\d+) dollars\. \w+ buys (\d+) notebooks and pays with a (\d+) dollar", lambda p, n, b: b - p * n),
    (r"reads (\d+) pages every day\. How many pages does \w+ read in (\d+) days", lambda a, b: a * b),
    (r"buys (\d+) packs of \w+ with (\d+) in each pack and already has (\d+)", lambda a, b, c: a * b + c),
    (r"cut into (\d+) equal slices\. \w+ eats (\d+) of them", lambda d, k: Fraction(k, d)),
]


def test_problems_are_seeded_distinct_and_their_answers_exact():
    rows = math_task.problems(300)
    assert rows == math_task.problems(300) and rows != math_task.problems(300, seed=1)
    assert len({r["extra_info"]["question"] for r in rows}) == 300
    kinds = set()
    for r in rows:
        q = r["extra_info"]["question"]
        assert r["prompt"] == [{"role": "user", "content": f"{q} {math_task.INSTRUCTION}"}]
        assert r["data_source"] == math_task.DATA_SOURCE and r["reward_model"]["style"] == "rule"
        (kind, want), = [(i, f(*map(int, m.groups()))) for i, (pat, f) in enumerate(SOLVE) if (m := re.search(pat, q))]
        kinds.add(kind)
        assert r["reward_model"]["ground_truth"] == math_task.answer_text(Fraction(want)), q
        assert Fraction(want) >= 0 and (Fraction(want).denominator == 1 or kind == 6)
    assert kinds == set(range(7))


def test_the_dataset_file_is_verl_parquet_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNARESIZE_CACHE", str(tmp_path / "a"))
    path = math_task.dataset_file(40)
    assert path.parent == tmp_path / "a" and path.suffix == ".parquet"
    recs = load_dataset(path)
    assert schema(recs) == "verl" and len(recs) == 40
    assert recs[3]["ground_truth"] == math_task.problems(40)[3]["reward_model"]["ground_truth"]
    mtime = path.stat().st_mtime_ns
    assert math_task.dataset_file(40) == path and path.stat().st_mtime_ns == mtime  # cached, not rewritten
    monkeypatch.setenv("DYNARESIZE_CACHE", str(tmp_path / "b"))
    assert math_task.dataset_file(40).read_bytes() == path.read_bytes()  # the same bytes on every machine


def test_the_task_and_the_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNARESIZE_CACHE", str(tmp_path))
    task = load_task(TaskConfig(name="arith"))
    assert task.reward_spec == MATH_REWARD and task.reward_style == "verl" and len(task.prompts) == 512
    assert "verl style" in task.about and "512 problems" in task.about
    cfg = build_config(preset("math"))
    assert cfg.task.name == "arith" and cfg.cluster.devices == 3 and cfg.policy.name == "scripted"
    assert cfg.policy.schedule == "2:1,4:2" and cfg.task.reward_workers == 2  # resizes each way
    assert math_task.compute_score("x", "so 40 + 2 = 42\n#### 42", "42") == {"score": 1.0, "answered": 1.0}
    assert math_task.compute_score("x", "bako bemi", "42") == {"score": 0.0, "answered": 0.0}
