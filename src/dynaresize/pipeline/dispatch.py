"""How a one-step-off step's requests are split over the rollout replicas: one share per replica,
sent at once, so an engine holds its whole share (up to its own `max_num_seqs` and KV, beyond
which its scheduler admits requests as slots free), not one prompt group at a time.

The split is the simulator's (`emulate.model.Emulator.rollout_plan`, `costmodel.stages`): the
request at batch position p = prompt x samples_per_prompt + sample goes to replica p mod R. It
is the same on the unpaced runtime and on an emulated one (which only adds each share's paced
time), so emulation paces the path a real run takes. A request's id and seed do not depend on
its share, so the split never changes what is generated.

The streaming pipeline's items (`stream_shares`) are the simulator's streaming shares: runs of
consecutive batch positions, as many requests as an engine holds at most; the runtime and the
emulator cut them alike (the emulator only paces them).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Sequence

SampleId = tuple[int, int, int]


def batch_position(sample_id: SampleId, samples_per_prompt: int) -> int:
    """Position of sample (step, prompt, sample) in its step's batch."""
    return int(sample_id[1]) * int(samples_per_prompt) + int(sample_id[2])


def replica_shares(sample_ids: Sequence[SampleId], num_replicas: int, samples_per_prompt: int) -> list[list[int]]:
    """Indices into `sample_ids` of each replica's share (replica j: batch positions p with
    p mod num_replicas == j, in position order); empty shares are dropped, so there are at most
    `num_replicas`. Raises ValueError for num_replicas < 1 or a repeated sample id."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("a sample id appears twice in one dispatch")
    order = sorted(range(len(sample_ids)), key=lambda i: batch_position(sample_ids[i], samples_per_prompt))
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in order:
        shares[batch_position(sample_ids[i], samples_per_prompt) % num_replicas].append(i)
    return [s for s in shares if s]


def stream_shares(sample_ids: Sequence[SampleId], num_replicas: int, samples_per_prompt: int,
                  slots: int) -> list[list[int]]:
    """The streaming pipeline's items for these requests of one step: indices into
    `sample_ids` in batch-position order, cut into consecutive runs of
    max(1, min(slots, ceil(len / num_replicas))) requests, the last one shorter (the
    simulator's cut, `sim.stream`, `Emulator.stream_shares`, for a whole step). Each is at most
    what an engine holds at once (`slots`), so an engine can always admit one whole; the router
    admits several into one engine while its slots allow (cluster/router.py). Raises ValueError
    for num_replicas < 1, slots < 1 or a repeated sample id."""
    if num_replicas < 1 or slots < 1:
        raise ValueError(f"num_replicas and slots must be >= 1, got {num_replicas} and {slots}")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("a sample id appears twice in one dispatch")
    order = sorted(range(len(sample_ids)), key=lambda i: batch_position(sample_ids[i], samples_per_prompt))
    share = max(1, min(int(slots), -(-len(order) // num_replicas)))
    return [order[lo:lo + share] for lo in range(0, len(order), share)]
