"""The training memory floor: one function (`costmodel.memory`) for the simulator, the emulator
and docs/gpu.md, counting what the trainer holds (16 B/param: fp32 master, gradients, two moments)."""

import re
from pathlib import Path

import pytest

from dynaresize.costmodel import costs, memory

GPU_DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
GB = 1e9


def test_the_floor_counts_gradients():
    assert memory.train_state_bytes(1e9) == 16e9  # 4 master + 4 gradient + 8 moments
    assert memory.train_state_bytes(1e9, reference=True) == 20e9
    # 7.62e9 parameters: 121.9 GB; 56 GB of an 80 GB device -> 3 devices (2 would hold 61 GB each)
    assert memory.min_train_devices_for(7.62e9, 80 * GB) == 3
    assert memory.min_train_devices_for(7.62e9, 141 * GB) == 2
    assert memory.min_train_devices_for(1e6, 80 * GB) == 1


@pytest.mark.parametrize("model", sorted(costs.MODEL_PRESETS))
def test_the_simulator_and_the_emulator_use_it(model):
    m = costs.get_model(model)
    assert m.train_state_bytes == memory.train_state_bytes(m.num_params)
    for name in ("h100", "h200", "a100", "h20"):
        hw = costs.get_hardware(name)
        assert costs.min_train_devices(m, hw) == memory.min_train_devices_for(m.num_params, hw.hbm_bytes)


def _training_rows() -> list[list[str]]:
    text = GPU_DOC.read_text()
    table = text.split("Training (FSDP2", 1)[1].split("\n\n", 2)[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_docs_gpu_training_table_is_the_functions_output():
    rows = _training_rows()
    assert len(rows) == 2
    for cells in rows:
        params = float(re.search(r"\(([\d.e]+) parameters\)", cells[0]).group(1))
        assert cells[1] == f"{memory.train_state_bytes(params) / GB:.1f} GB"
        for cell, hbm in ((cells[2], 80 * GB), (cells[3], 141 * GB)):
            w = memory.min_train_devices_for(params, hbm)
            assert cell == f"{w} ({memory.train_state_bytes(params) / w / GB:.1f} GB each)", cell
