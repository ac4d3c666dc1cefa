"""Rollout replicas on the runtime: with `rollout.tensor_parallel = k` a replica is k device
workers, one vLLM tensor-parallel rank in each (roles/vllm_tp.py), moved, served and lost whole.

Invariants:
- the rollout pool is a whole number of replicas (the bounds' move unit is a multiple of k,
  `emulate.model.run_bounds`); a replica is k consecutive rollout ranks, in rank order, and all
  of them sit on one node (`replicas_of` refuses otherwise: vLLM's TP group is node-local here);
- its first rank, the leader, answers for it (results, progress); every rank gets the same calls
  in the same order with the same arguments (`call`), since each rank runs its own copy of vLLM's
  scheduler in lockstep with the others (`serve` counts its slice in iterations there);
- a replica is formed with a fresh rendezvous port on its leader's node (`place`), sent to its
  ranks before the call that starts their engines; with k = 1 nothing is sent and every device
  is its own replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Replica = tuple[int, ...]


def replicas_of(rollout: Sequence[int], k: int, node_of: Callable[[int], str] | None = None) -> list[Replica]:
    """The replicas of rollout ranks `rollout`: consecutive chunks of k, in rank order."""
    ranks = sorted(int(d) for d in rollout)
    if k < 1 or len(ranks) % k:
        raise ValueError(f"rollout pool {ranks} is not a whole number of replicas of {k} devices "
                         "(rollout.tensor_parallel)")
    out = [tuple(ranks[i:i + k]) for i in range(0, len(ranks), k)]
    if node_of is not None and k > 1:
        for rep in out:
            nodes = {node_of(d) for d in rep}
            if len(nodes) > 1:
                raise RuntimeError(f"rollout replica {list(rep)} spans nodes {sorted(nodes)}: a tensor-parallel "
                                   f"replica needs its {k} devices on one node (use cluster.placement_strategy="
                                   "PACK, or device counts per node that are multiples of rollout.tensor_parallel)")
    return out


def replica_of(replicas: Sequence[Replica]) -> dict[int, Replica]:
    """Each rank's replica (looked up by any of its ranks; its leader is its first rank)."""
    return {d: rep for rep in replicas for d in rep}


def place(workers: Sequence[Any], replicas: Sequence[Replica], node_ip: Callable[[int], str],
          port_on: Callable[[int], int]) -> list[tuple[int, Any]]:
    """Queue `set_replica` on every rank of `replicas` (nothing for TP1 replicas): a fresh port
    for each, free on its leader's node (asked there) and not given to another replica of
    this call (`port_on(rank)`: a free port on that rank's node). Returns (rank, ref) pairs, ordered before any later call of the driver."""
    tp = [rep for rep in replicas if len(rep) > 1]
    taken: set[tuple[str, int]] = set()
    out = []
    for rep in tp:
        addr = node_ip(rep[0])
        for _ in range(8):  # a port handed to another replica of this call: ask again
            port = int(port_on(rep[0]))
            if (addr, port) not in taken:
                break
        taken.add((addr, port))
        out += [(d, workers[d].set_replica.remote(list(rep), addr, port)) for d in rep]
    return out


class ReplicaCall:
    """One call sent to every rank of a replica (same method, same arguments): it has ended
    when every rank answered, and its answer is the leader's once the others agree."""

    def __init__(self, invoke: Callable[[int], Any], rep: Replica) -> None:
        self.leader = rep[0]
        self.refs = {invoke(d): d for d in rep}  # ref -> rank
        self.waiting = set(self.refs)
        self.answers: dict[int, Any] = {}  # rank -> its answer, or the exception it raised

    def take(self, ref: Any, value: Any) -> bool:
        """Note one rank's answer (or exception); True once every rank answered."""
        self.waiting.discard(ref)
        self.answers[self.refs[ref]] = value
        return not self.waiting

    def result(self) -> dict:
        """The leader's answer; a rank's own error is raised (not a lost device: the caller
        drops a replica with a lost rank before asking)."""
        for value in self.answers.values():
            if isinstance(value, BaseException):
                raise value
        lead = self.answers[self.leader]
        agree(lead, [v for d, v in self.answers.items() if d != self.leader])
        return lead


def agree(leader: dict, others: Sequence[dict]) -> None:
    """The other ranks' answers to a call the leader answered: the same sample ids finished and
    still running, or the replica's ranks diverged (a bug: they run one schedule)."""
    mine = (sorted(tuple(r.sample_id) for r in leader.get("results", [])), leader.get("running"))
    for g in others:
        theirs = (sorted(tuple(r.sample_id) for r in g.get("results", [])), g.get("running"))
        if theirs != mine:
            raise RuntimeError(f"tensor-parallel ranks diverged: leader device {leader.get('device')} finished "
                               f"{mine[0][:4]} ({mine[1]} running), device {g.get('device')} {theirs[0][:4]} "
                               f"({theirs[1]} running)")
