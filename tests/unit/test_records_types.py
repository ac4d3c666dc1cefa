import json
import math

import pytest

from dynaresize.records import Recorder, make_record, read_records
from dynaresize.types import Assignment, Bounds, Keep, Move, move_to


def test_recorder_appends_valid_jsonl(tmp_path):
    path = tmp_path / "r" / "records.jsonl"
    with Recorder(path) as rec:
        rec.emit("decision", step=1, action="keep", reason="x", extra=math.inf)
        rec.emit("summary", summary={"a": 1})
    lines = path.read_text().splitlines()
    assert [json.loads(l)["kind"] for l in lines] == ["decision", "summary"]
    assert json.loads(lines[0])["extra"] is None  # no NaN/inf in strict JSON
    assert [r["kind"] for r in read_records(path, "summary")] == ["summary"]


def test_schema_is_enforced():
    with pytest.raises(ValueError):
        make_record("step", step=1)
    with pytest.raises(ValueError):
        make_record("nonsense")


def test_assignment_and_bounds():
    a = Assignment.split(6, 2)
    assert a.devices("rollout") == (0, 1) and a.num_train == 4
    b = a.moved((2,), "rollout")
    assert b.num_rollout == 3
    bounds = Bounds(num_devices=8, min_rollout=2, min_train=2, move_unit=2)
    assert bounds.splits() == (2, 4, 6)
    assert bounds.why_not(3) and bounds.why_not(4) is None and bounds.why_not(8)
    assert bounds.nearest(5.1) == 6 and bounds.nearest(5) == 4


def test_move_to():
    assert isinstance(move_to(3, 3), Keep)
    m = move_to(3, 5)
    assert isinstance(m, Move) and m.dst == "rollout" and m.num_devices == 2 and m.target_rollout(3) == 5
    assert move_to(3, 1).dst == "train"
