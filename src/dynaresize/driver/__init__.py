"""The driver: the run loop of a real job and what only it uses.

`run` (the top loop: one-step-off windows, reports, the controller's commands), `streaming`
(the streaming window at staleness >= 2), `accumulate` (training a step as its samples
arrive), `recovery` (re-forming the world after a lost device or node), `checkpointing`,
`evaluation`, `job` (prompts, samples, rewards of the RL task) and `ledger` (every sample
generated once, consumed once). It drives the cluster and feeds the record stream.
"""
