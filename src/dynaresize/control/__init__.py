"""The controller: turns step reports into resize commands through an explicit state machine.

Pure: no Ray, torch, I/O or clock reads. The same controller drives the simulator and the
real runtime.
"""
