"""Cluster-scale simulator: workload and cost models, a one-step-off pipeline engine, and a
shell that drives the same controller and policies the real runtime uses.

Pure (numpy only): no Ray, torch, clock reads or I/O, except `sim.trace` (reads a trace file)
and `sim.shell` (writes records through `records.Recorder`).
"""
