"""Where vLLM is required (CI=true or DYNARESIZE_REQUIRE_VLLM=1) a test marked `vllm` fails with
one line when vLLM is missing; elsewhere it skips, saying why (tests/conftest.py)."""

import sys

import pytest
from _pytest.outcomes import Failed, Skipped

import conftest


class _Item:
    def __init__(self, marked: bool):
        self.marked = marked

    def get_closest_marker(self, name):
        return object() if self.marked and name == "vllm" else None


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib.util.find_spec("vllm") is None now
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DYNARESIZE_REQUIRE_VLLM", raising=False)


@pytest.mark.parametrize("env", [("CI", "true"), ("DYNARESIZE_REQUIRE_VLLM", "1")])
def test_a_vllm_test_fails_where_vllm_is_required(no_vllm, monkeypatch, env):
    monkeypatch.setenv(*env)
    with pytest.raises(Failed) as info:
        conftest.pytest_runtest_setup(_Item(marked=True))
    assert "vLLM is required here" in str(info.value) and "\n" not in str(info.value)


def test_a_vllm_test_skips_elsewhere_and_other_tests_run(no_vllm):
    with pytest.raises(Skipped, match="vllm is not installed"):
        conftest.pytest_runtest_setup(_Item(marked=True))
    conftest.pytest_runtest_setup(_Item(marked=False))  # nothing raised
