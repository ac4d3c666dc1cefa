"""`dynaresize advise`: what dynamic resizing would do for a user's own job, from its logs.

`logs` maps a framework's logged keys to per-step metrics, `lengths` rebuilds each step's
response lengths from the logged mean / max / clip ratio, `calibrate` fits the simulator's
stage models to the logged stage times, `job` puts them together, and `answer` runs the
simulator's sweeps, the hysteresis policy and the oracle on the result (docs/advise.md).

Pure: no I/O (the command reads the files), no torch, no Ray.
"""
