"""Trace files: valid ones load, malformed ones name the file and line."""

import json

import numpy as np
import pytest

from dynaresize.errors import TraceError
from dynaresize.workload.trace import DEFAULT_PROMPT_TOKENS, load_trace, parse_trace_lines, write_trace


def test_valid_trace_with_and_without_prompt_tokens(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"step": 0, "response_tokens": [5, 7], "prompt_tokens": [3, 4]}\n\n'
                 '{"step": 1, "response_tokens": [0, 9, 1]}\n')
    batches = load_trace(p)
    assert [b.num_samples for b in batches] == [2, 3]
    assert batches[0].prompt_tokens.tolist() == [3, 4]
    assert batches[1].prompt_tokens.tolist() == [DEFAULT_PROMPT_TOKENS] * 3


def test_round_trip(tmp_path):
    p = tmp_path / "t.jsonl"
    batches = parse_trace_lines(['{"step": 0, "response_tokens": [1, 2]}', '{"step": 3, "response_tokens": [4]}'])
    write_trace(p, batches)
    again = load_trace(p)
    assert [b.response_tokens.tolist() for b in again] == [[1, 2], [4]]


@pytest.mark.parametrize("line,needle", [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"response_tokens": [1]}', "step must be"),
    ('{"step": -1, "response_tokens": [1]}', "step must be"),
    ('{"step": 0}', "missing response_tokens"),
    ('{"step": 0, "response_tokens": []}', "empty"),
    ('{"step": 0, "response_tokens": [3, -2]}', "response_tokens[1] = -2 is negative"),
    ('{"step": 0, "response_tokens": [3, 2.5]}', "not an integer"),
    ('{"step": 0, "response_tokens": [3, true]}', "not an integer"),
    ('{"step": 0, "response_tokens": 7}', "must be a list"),
    ('{"step": 0, "response_tokens": [1, 2], "prompt_tokens": [1]}', "prompt_tokens has 1 entries"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"step": 0, "response_tokens": [4]}).replace('"step": 0', '"step": 0') + "\n"
                 + line.replace('"step": 0', '"step": 1') + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert f"{p}:2:" in msg and needle in msg and "\n" not in msg


def test_steps_must_increase_and_file_must_exist(tmp_path):
    with pytest.raises(TraceError, match=r"<trace>:2: step 0 does not follow step 0"):
        parse_trace_lines(['{"step": 0, "response_tokens": [1]}', '{"step": 0, "response_tokens": [1]}'])
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="no steps"):
        parse_trace_lines(["", "  "])
    assert isinstance(parse_trace_lines(['{"step": 2, "response_tokens": [1]}'])[0].response_tokens, np.ndarray)
