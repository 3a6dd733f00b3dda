"""Which of a plan's work units a rank runs: pure, from the plan alone.

Every rank builds the same deterministic plan, so each can compute the same assignment without
talking to the others: units (output shards, items, files) go largest first to the least-loaded
rank (ties to the lowest rank), which keeps the ranks' bytes within one unit of each other. One
process is `Part(0, 1)` and owns everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SOLO", "Part", "assign_units", "working_ranks"]


def assign_units(weights: Sequence[int], world: int) -> tuple[int, ...]:
    """The owner rank of each unit, by its weight (bytes): largest first onto the least-loaded rank."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    owners = [0] * len(weights)
    load = [0] * world
    for i in sorted(range(len(weights)), key=lambda i: (-int(weights[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += int(weights[i])
    return tuple(owners)


def working_ranks(weights: Sequence[int], world: int, min_bytes_per_rank: int) -> int:
    """How many of `world` ranks get units of a read-only job weighing `weights` (bytes): one per
    `min_bytes_per_rank` of work, at least 1, at most one per unit. A rank costs its start-up, the
    collectives and a share of the node's cores; below that much work it saves less than it costs, so
    the ranks past this number stay idle and the working ones take the cores (`dist.local_workers`).
    `min_bytes_per_rank` <= 0: every rank works."""
    if world <= 1:
        return 1
    if min_bytes_per_rank <= 0:
        return max(1, min(world, len(weights)))
    return max(1, min(world, len(weights), sum(int(w) for w in weights) // min_bytes_per_rank))


@dataclass(frozen=True)
class Part:
    """This process's share of a plan: rank `rank` of `world`."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")

    @property
    def leader(self) -> bool:
        """Rank 0: it writes the index / .metadata and commits OUT."""
        return self.rank == 0

    def mine(self, weights: Sequence[int]) -> tuple[int, ...]:
        """Indices (ascending) of the units this rank runs, out of units weighing `weights`."""
        if self.world == 1:
            return tuple(range(len(weights)))
        return tuple(i for i, r in enumerate(assign_units(weights, self.world)) if r == self.rank)


SOLO = Part(0, 1)
