"""Emulated accelerators: the cost model's pacing of real work (`model`), the run's emulated
clock (`clock`), the config checks emulation needs (`check`) and the simulator's prediction of
an emulated job (`predict`).

Layer: under `cluster` (which paces its workers with `model` and `clock`), over the simulator,
the policies and the cost models. `model`, `clock` and `check` never import `sim`, so the
cluster stays independent of the simulator.
"""
