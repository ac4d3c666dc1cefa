"""Cluster-scale simulator: cost models, a one-step-off pipeline engine (`engine`), a streaming
pipeline engine with bounded staleness (`stream`), and a shell that drives the same controller
and policies the real runtime uses. Workloads live in `dynaresize.workload` (shared with the
runtime); `sim.workload` and `sim.trace` re-export them.

Pure (numpy only): no Ray, torch, clock reads or I/O, except `sim.trace` (reads a trace file)
and `sim.shell` (writes records through `records.Recorder`).
"""
