"""Cost models shared by the simulator and the emulated runtime.

`costs` (each resize op's cost, weight-sync and reshard times; it re-exports the accelerators
of `hardware` and the model presets of `model_presets`), `lora` (a LoRA adapter's size and what
its moves and syncs carry), `memory` (bytes per device), `stages` (a stage's time against its device count: continuous-batching rollout
replicas, training FLOPs) and `scenarios` (a modelled job: workload, devices, model, hardware
and its bounds). Pure (numpy only): no Ray, torch, I/O or clock. The simulator (`sim`) runs
them as timed events; the emulator (`emulate`) paces real workers by them.
"""
