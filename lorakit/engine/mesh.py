"""The process grid of a run: data-parallel replicas x sequence-parallel groups.

With `distributed.sequence_parallel: N`, the world's ranks form groups of N consecutive ranks (one node's
GPUs, where the all-to-alls of sequence parallelism are cheap); each group trains the same packed rows,
every rank a 1/N slice of each row. The groups are the data-parallel replicas: samplers and batching
split the data over `dp_world` replicas by `dp_rank`, not over the global ranks.

    world 8, N 4:   sp groups {0,1,2,3} {4,5,6,7}     dp groups {0,4} {1,5} {2,6} {3,7}

The backend still averages gradients over all ranks (it knows nothing of the grid); lorakit's token-weighted
loss accounts for that (lorakit.data.sequence_split gives each shard its own share of a row's counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lorakit.errors import RecipeError


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the grid and the process group of its sequence-parallel group (None when the
    group is this process alone, or without torch.distributed). Data-parallel replicas need no group of
    their own: the backend reduces gradients over every rank, and the loop's sums are over every rank."""

    world: int
    rank: int
    sp_world: int = 1
    sp_group: Any = None

    @property
    def sp_rank(self) -> int:
        """This rank's index within its sequence-parallel group: which slice of each row it holds."""
        return self.rank % self.sp_world

    @property
    def dp_world(self) -> int:
        """The number of data-parallel replicas (sequence-parallel groups)."""
        return self.world // self.sp_world

    @property
    def dp_rank(self) -> int:
        """This rank's replica: which share of the data its group trains on."""
        return self.rank // self.sp_world

    @property
    def sequence_parallel(self) -> bool:
        """Whether rows are split over several ranks."""
        return self.sp_world > 1

    @classmethod
    def build(cls, sequence_parallel: int = 1) -> ParallelDims:
        """The grid for the initialised process group (collective: every rank creates every group)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        check_world(sequence_parallel, world)
        if sequence_parallel == 1:
            return cls(world, rank)
        sp_group = None
        # new_group is collective over the whole world: every rank creates every group in the same order.
        for start in range(0, world, sequence_parallel):
            ranks = list(range(start, start + sequence_parallel))
            group = dist.new_group(ranks)
            if rank in ranks:
                sp_group = group
        return cls(world, rank, sequence_parallel, sp_group)


def check_world(sequence_parallel: int, world: int) -> None:
    """Refuse a sequence-parallel degree that does not divide the number of processes."""
    if world % sequence_parallel:
        raise RecipeError(
            f"distributed.sequence_parallel {sequence_parallel} must divide the number of processes "
            f"({world}): every sequence-parallel group needs its {sequence_parallel} ranks"
        )
