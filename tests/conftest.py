"""Test-wide settings: no model hub, no Ray token auth, one torch thread; the `vllm` mark."""

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest


def vllm_required() -> bool:
    """Where vLLM is expected (CI, or DYNARESIZE_REQUIRE_VLLM=1), its absence fails a vLLM test
    instead of skipping it: coverage must not vanish because an install step quietly failed."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("DYNARESIZE_REQUIRE_VLLM") == "1"


def skip_or_fail_without_vllm(problem: str) -> None:
    """Skip (saying why) where vLLM is optional; fail with one line where it is required."""
    if vllm_required():
        pytest.fail(f"vLLM is required here (CI=true or DYNARESIZE_REQUIRE_VLLM=1) but {problem}", pytrace=False)
    pytest.skip(problem)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `vllm` need the vllm package (`make setup` installs it)."""
    if item.get_closest_marker("vllm") is not None and importlib.util.find_spec("vllm") is None:
        skip_or_fail_without_vllm("vllm is not installed (make setup installs it; scripts/install_vllm.sh)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Pin torch to one thread for a module: bitwise results need a fixed thread count."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
