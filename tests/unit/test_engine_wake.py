"""A parked engine checks the free memory before it wakes and says so in one line when the
bytes it gave back are not free (roles/rollout_vllm.py `unpark`, roles/device_memory.py), instead
of failing inside vLLM. The vLLM engine's own object with a stand-in `LLM` (sleep/wake_up)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from dynaresize.roles import device_memory, rollout_vllm  # noqa: E402
from dynaresize.roles.device_memory import wake_problem  # noqa: E402

GIB = 1 << 30


class _LLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append("reset")
        return True  # nothing running: vLLM resets (roles/vllm_weights.reset_prefix_cache)


def _engine(monkeypatch, free: list[int]):
    """A parked-capable engine on a stand-in CUDA device whose free bytes are read from `free`."""
    eng = object.__new__(rollout_vllm.VLLMRolloutEngine)
    eng._llm, eng._parked, eng._park_bytes = _LLM(), False, 0
    monkeypatch.setattr(rollout_vllm.VLLMRolloutEngine, "_sleep_mode", staticmethod(lambda: True))
    monkeypatch.setattr(rollout_vllm.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_memory, "release_device_memory", lambda device: None)
    monkeypatch.setattr(device_memory, "free_device_bytes", lambda device: free.pop(0))
    return eng


def test_a_wake_without_the_memory_it_gave_back_says_so_in_one_line(monkeypatch):
    eng = _engine(monkeypatch, free=[10 * GIB, 50 * GIB, 30 * GIB])  # park frees 40 GiB; only 30 free at wake
    assert eng.park() is True and eng._park_bytes == 40 * GIB
    with pytest.raises(RuntimeError) as info:
        eng.unpark()
    msg = str(info.value)
    assert "\n" not in msg and "needs 40.00 GiB" in msg and "30.00 GiB free" in msg and "cuda:0" in msg
    assert eng._llm.calls == ["sleep1"] and eng._parked  # vLLM was never asked to wake


def test_a_wake_that_fits_wakes_and_resets_the_prefix_cache(monkeypatch):
    eng = _engine(monkeypatch, free=[10 * GIB, 50 * GIB, 45 * GIB])
    eng.park()
    eng.unpark()
    assert eng._llm.calls == ["sleep1", "wake_up", "reset"] and not eng._parked


def test_wake_problem_is_silent_without_figures():
    assert wake_problem(0, 1, "e") is None and wake_problem(5, None, "e") is None and wake_problem(5, 5, "e") is None
    assert wake_problem(6, 5, "e").startswith("e cannot wake")
