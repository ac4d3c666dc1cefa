"""Pure schedules of the pipelined job that both the driver and the cluster read.

`stepstate` (which weight version a step's rollout uses, the window of steps in flight) and
`streamplan` (the streaming queue: shares of a step and when a step is released). Pure: no
Ray, torch, I/O or clock; they import nothing above the shared vocabulary.
"""
