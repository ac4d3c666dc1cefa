"""Pure schedules of the pipelined job that both the driver and the cluster read.

`stepstate` (which weight version a step's rollout uses, the window of steps in flight),
`streamplan` (the streaming queue: shares of a step, when a step is released, which engine
admits which item) and `concurrency` (requests in flight per replica as a compact step
function). Pure: no
Ray, torch, I/O or clock; they import nothing above the shared vocabulary.
"""
