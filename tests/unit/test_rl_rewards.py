"""Reward plug-ins: loading by module or file path, and scoring with on_error fail/zero."""

from __future__ import annotations

import math

import pytest

from dynaresize.errors import RewardError, UserError
from dynaresize.rl.rewards import load_reward, score


def _reward_file(tmp_path, body: str, name: str = "my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_load_from_module_and_file(tmp_path):
    fn = load_reward("dynaresize.rl.tasks:toy_count_reward")
    assert fn("p", "bako bemi zz", {"letter": "b"}) == pytest.approx(2 / 3)
    path = _reward_file(tmp_path, "def exact(prompt, response, fields):\n"
                                  "    return float(response.strip() == str(fields['answer']))\n")
    fn = load_reward(f"{path}:exact")
    assert fn("2+2=", " 4 ", {"answer": 4}) == 1.0
    assert fn("2+2=", "5", {"answer": 4}) == 0.0


def test_same_stem_files_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _reward_file(tmp_path / "a", "def r(p, x, f):\n    return 1.0\n", "rw.py")
    two = _reward_file(tmp_path / "b", "def r(p, x, f):\n    return 2.0\n", "rw.py")
    assert load_reward(f"{one}:r")("", "", {}) == 1.0
    assert load_reward(f"{two}:r")("", "", {}) == 2.0


@pytest.mark.parametrize("spec, what", [
    ("no_colon", "expected module:function"),
    (":fn", "expected module:function"),
    ("mod:", "expected module:function"),
    ("dynaresize_no_such_module:fn", "not found"),
    ("dynaresize.rl.tasks:no_such_fn", "has no attribute 'no_such_fn'"),
    ("dynaresize.rl.tasks:TOY_TASK", "is not callable"),
    ("missing/dir/r.py:fn", "not found"),
])
def test_bad_specs_name_the_spec(spec, what):
    with pytest.raises(UserError) as exc:
        load_reward(spec)
    assert repr(spec) in str(exc.value) and what in str(exc.value)


def test_broken_reward_file(tmp_path):
    path = _reward_file(tmp_path, "def r(:\n")
    with pytest.raises(UserError, match="SyntaxError"):
        load_reward(f"{path}:r")


def _raises(prompt, response, fields):
    raise KeyError("answer")


@pytest.mark.parametrize("fn, what", [
    (_raises, "raised KeyError"),
    (lambda p, r, f: float("nan"), "non-finite"),
    (lambda p, r, f: math.inf, "non-finite"),
    (lambda p, r, f: "1.0", "returned str, not a number"),
    (lambda p, r, f: None, "returned NoneType"),
])
def test_score_bad_rewards(fn, what):
    with pytest.raises(RewardError) as exc:
        score(fn, "p", "r", {}, "fail")
    assert what in str(exc.value) and "\n" not in str(exc.value)
    value, reason = score(fn, "p", "r", {}, "zero")
    assert value == 0.0 and what in reason


def test_score_good_rewards():
    assert score(lambda p, r, f: 1, "p", "r", {}, "fail") == (1.0, None)
    assert score(lambda p, r, f: len(r) / 10, "p", "abc", {}, "zero") == (0.3, None)
    with pytest.raises(ValueError):
        score(lambda p, r, f: 1.0, "p", "r", {}, "ignore")
