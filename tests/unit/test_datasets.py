"""Datasets as users have them (rl/dataset.py): verl's and TRL's schemas in parquet and JSONL,
task.columns for other layouts, and one line naming file, row and field for each bad input."""

from __future__ import annotations

import json

import pytest

from dynaresize.config import TaskConfig
from dynaresize.config_load import build_config, merge
from dynaresize.errors import ConfigError, DataError, UserError
from dynaresize.presets import preset
from dynaresize.rl.data import reward_fields
from dynaresize.rl.dataset import load_dataset, schema, write_parquet
from dynaresize.rl.tasks import load_task

VERL_ROWS = [{"data_source": "openai/gsm8k",
              "prompt": [{"role": "user", "content": f"What is {a} + {a}? Put the answer after ####."}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
              "extra_info": {"split": "train", "index": a}} for a in range(3)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_verl_rows_keep_their_columns_and_lift_the_ground_truth(tmp_path, fmt):
    path = tmp_path / f"train.{fmt}"
    write_parquet(VERL_ROWS, path) if fmt == "parquet" else _jsonl(path, VERL_ROWS)
    recs = load_dataset(path)
    assert schema(recs) == "verl" and len(recs) == 3
    assert recs[1]["prompt"] == VERL_ROWS[1]["prompt"]  # chat messages, as written
    fields = reward_fields(recs[1])
    assert fields["ground_truth"] == "2" and fields["data_source"] == "openai/gsm8k"
    assert fields["extra_info"] == {"split": "train", "index": 1} and fields["reward_model"]["style"] == "rule"


def test_trl_rows_and_columns_for_other_layouts(tmp_path):
    trl = _jsonl(tmp_path / "trl.jsonl", [{"prompt": "2+2=", "answer": "4", "level": 1}])
    (rec,) = load_dataset(trl)
    assert schema([rec]) == "trl" and rec == {"prompt": "2+2=", "answer": "4", "level": 1}
    qa = tmp_path / "qa.parquet"
    write_parquet([{"question": "3+3=", "sol": {"final": "6"}, "src": "mine"}], qa)
    (rec,) = load_dataset(qa, {"prompt": "question", "ground_truth": "sol.final", "data_source": "src"})
    assert rec["prompt"] == "3+3=" and rec["ground_truth"] == "6" and rec["data_source"] == "mine"
    assert rec["question"] == "3+3="  # the named column stays under its own name


@pytest.mark.parametrize("rows, columns, where, what", [
    ([{"prompt": "a", "text": "a"}, {"prompt": None, "text": "b"}], {}, "row 1",
     'missing "prompt" field (fields: text)'),
    ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "user"}]}], {}, "row 1",
     '"prompt"[0].content must be a string (missing)'),
    ([{"prompt": []}], {}, "row 0", '"prompt" is an empty list of chat messages'),
    ([{"q": "a"}], {"prompt": "question"}, "row 0", "missing field 'question' (task.columns prompt=question"),
    ([VERL_ROWS[0], {**VERL_ROWS[1], "reward_model": {"style": "rule", "ground_truth": None}}], {}, "row 1",
     'missing field "reward_model.ground_truth"'),
])
def test_a_bad_parquet_row_is_one_line_naming_file_row_and_field(tmp_path, rows, columns, where, what):
    path = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(DataError) as exc:
        load_dataset(path, columns)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: {where}: ") and what in msg and "\n" not in msg, msg


@pytest.mark.parametrize("rows, line, what", [
    ([{"prompt": "a"}, {"prompt": 7}], 2, '"prompt" must be a string or a list of chat messages, got int'),
    ([{"prompt": "a"}, ["prompt"]], 2, 'expected a JSON object with a "prompt" field, got list'),
    ([{**VERL_ROWS[0], "extra_info": "x"}], 1, '"extra_info" must be a struct (a dict), got str'),
    ([{**VERL_ROWS[0], "reward_model": "4"}], 1, '"reward_model" must be a struct with a "ground_truth" field'),
    ([{"prompt": "  "}], 1, '"prompt" is empty'),
])
def test_a_bad_jsonl_row_is_one_line_naming_file_line_and_field(tmp_path, rows, line, what):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as exc:
        load_dataset(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:{line}: ") and what in msg and "\n" not in msg, msg


def test_bad_files_are_one_line(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_dataset(junk)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2: bad JSON"):
        load_dataset(bad)
    with pytest.raises(DataError, match="empty.jsonl: no prompts"):
        load_dataset(_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DataError, match="gone.parquet: dataset not found"):
        load_dataset(tmp_path / "gone.parquet")


def test_config_checks_the_task_fields_and_the_file(tmp_path):
    base = preset("cpu")
    with pytest.raises(ConfigError) as exc:
        build_config(merge(base, {"task": {"dataset": str(tmp_path / "nope.parquet"), "prompts_file": "x.jsonl",
                                           "columns": "prompt=q,answer=a", "reward_style": "keras",
                                           "reward_workers": 0, "reward_timeout_s": 0, "name": "arith"}}))
    lines = exc.value.errors
    for needle in ("task.dataset=", "file not found", "task.prompts_file='x.jsonl': the old name of task.dataset",
                   "'answer' is not a role", "task.reward_style='keras'", "task.reward_workers=0",
                   "task.reward_timeout_s=0.0", "task.name='arith': unused with task.dataset"):
        assert any(needle in line for line in lines), (needle, lines)
    ok = _jsonl(tmp_path / "ok.jsonl", [{"question": "q"}])
    cfg = build_config(merge(base, {"task": {"dataset": str(ok), "columns": "prompt=question", "reward": "m:f"}}))
    assert cfg.task.columns == {"prompt": "question"}
    with pytest.raises(ConfigError, match="eval.prompts_file=None: needed to evaluate a task from task.dataset"):
        build_config(merge(base, {"task": {"dataset": str(ok), "reward": "m:f"}, "eval": {"every_steps": 2}}))


def test_a_reward_that_cannot_take_its_style_is_refused_at_load(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    (tmp_path / "r.py").write_text("def two(a, b):\n    return 1.0\n\n"
                                   "def needs_solution(completions, solution):\n    return [1.0]\n")
    with pytest.raises(UserError, match="cannot tell its style from its parameters \\(a, b\\)"):
        load_task(TaskConfig(dataset=str(data), reward=f"{tmp_path / 'r.py'}:two"))
    with pytest.raises(UserError, match="the trl style calls it as .*answer=.*which its signature"):
        load_task(TaskConfig(dataset=str(data), reward=f"{tmp_path / 'r.py'}:needs_solution"))
    with pytest.raises(UserError, match="the verl style calls it"):
        load_task(TaskConfig(dataset=str(data), reward=f"{tmp_path / 'r.py'}:two", reward_style="verl"))


def test_chat_prompts_go_through_a_chat_template(tmp_path):
    """The built-in tokenizer renders chat prompts with its small template; a model folder
    without a template is refused for them (one line, before anything runs)."""
    from dynaresize.config import ModelConfig
    from dynaresize.driver.job import Job
    from dynaresize.rl.models import build_model, build_tokenizer, save_hf

    data = _jsonl(tmp_path / "chat.jsonl", VERL_ROWS)
    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 600}
    task = {"dataset": str(data), "reward": "dynaresize.rl.tasks:toy_count_reward"}
    job = Job(build_config(merge(preset("cpu"), {"model": tiny, "task": task})))
    (first,) = [r for r in job.prompts if r["extra_info"]["index"] == 2]
    text = job.tokenizer.decode(job.encode(first))
    assert text == f"<bos>user : {VERL_ROWS[2]['prompt'][0]['content']}<eos><bos>assistant :"
    save_hf(build_model(ModelConfig(**tiny)), build_tokenizer(600), tmp_path / "plain")  # no chat template
    with pytest.raises(ConfigError, match=f"task '{data}': its prompts are chat messages, and the tokenizer of "
                                          "model.path='.*plain' has no chat template"):
        Job(build_config(merge(preset("cpu"), {"model": {"path": str(tmp_path / "plain")}, "task": task})))
