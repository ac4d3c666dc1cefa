"""Test-wide settings: no model hub, no Ray token auth, one torch thread."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Pin torch to one thread for a module: bitwise results need a fixed thread count."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
