"""Length-grouped batches, sharded so every rank gets the same number of similar-length batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# Batches are formed within windows of this many batches per rank: long enough that each window holds
# a spread of lengths to sort, short enough that the order still looks shuffled to the optimizer.
_WINDOW_BATCHES = 64


class LengthGroupedBatchSampler:
    """Yields this rank's micro-batches (lists of dataset indices) of examples with similar lengths.

    Padding to the longest member of a batch then wastes little (with group_by_length=False, batches are
    random: what a plain shuffled DataLoader gives, kept for comparisons). Each epoch is a deterministic shuffle
    from (seed, epoch). Every rank gets exactly `len(self)` batches: without drop_last the index list is
    padded with repeats from its start (like torch's DistributedSampler); with drop_last the remainder
    that does not fill a batch on every rank is dropped and reported by `dropped`.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        group_by_length: bool = True,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas {num_replicas}")
        if len(lengths) == 0:
            raise ValueError("no examples to batch")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.drop_last, self.epoch = seed, drop_last, 0
        self.group_by_length = group_by_length
        group = batch_size * num_replicas
        n = len(self.lengths)
        self.total = (n // group) * group if drop_last else -(-n // group) * group
        if self.total == 0:
            raise ValueError(
                f"{n} examples cannot fill one batch of {batch_size} on each of {num_replicas} ranks with drop_last"
            )
        self.dropped = max(n - self.total, 0)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for `epoch`."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.total // (self.batch_size * self.num_replicas)

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i]."""
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(len(self.lengths))
        if self.total > len(order):
            order = np.concatenate([order, order[: self.total - len(order)]])
        order = order[: self.total]
        group = self.batch_size * self.num_replicas
        window = group * _WINDOW_BATCHES
        groups = []
        for start in range(0, self.total, window):
            chunk = order[start : start + window]
            if self.group_by_length:
                # Stable sort, longest first, so batches of a window hold neighbours in length.
                chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            groups.extend(chunk[i : i + group] for i in range(0, len(chunk), group))
        rng.shuffle(groups)
        per_rank: list[list[list[int]]] = [[] for _ in range(self.num_replicas)]
        for g in groups:
            # The ranks of one step share a group of similar lengths, so no rank waits on a longer batch.
            for r in range(self.num_replicas):
                per_rank[r].append(g[r * self.batch_size : (r + 1) * self.batch_size].tolist())
        return per_rank

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.rank])


class ResumableBatchSampler:
    """Wraps a batch sampler so a resumed run skips the micro-batches its checkpoint had already trained.

    The wrapped samplers are deterministic per (seed, epoch), so skipping the first `skip` batches of the
    resumed epoch yields exactly the batches the interrupted run would have seen next. Only indices are
    skipped: no example is loaded or collated for them. The skip applies once, to the next iteration.
    """

    def __init__(self, sampler):
        self.sampler = sampler
        self.skip = 0

    @property
    def dropped(self) -> int:
        return self.sampler.dropped

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def skip_next(self, batches: int) -> None:
        """Leave out the first `batches` batches of the next epoch iterated."""
        if not 0 <= batches <= len(self.sampler):
            raise ValueError(f"cannot skip {batches} of {len(self.sampler)} batches")
        self.skip = batches

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(self.sampler):
            if i >= skip:
                yield batch
