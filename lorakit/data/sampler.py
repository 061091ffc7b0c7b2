"""What every batch sampler shares, and the length-grouped sampler of padded micro-batches.

A batch sampler yields this rank's micro-batches (lists of dataset indices). The contract every sampler
here keeps: `set_epoch(epoch)` reshuffles deterministically from (seed, epoch); `len()` is exact and the
same on every rank; `all_batches()` gives every rank's batches of the epoch, `iter()` this rank's;
`dropped` counts the examples an epoch leaves out. So a resumed run skips the batches it trained by
number (ResumableBatchSampler).

The samplers: LengthGroupedBatchSampler (here), BalancedRandomBatchSampler (balanced.py),
TokenBudgetBatchSampler (token_budget.py), MultipackBatchSampler (multipack.py) and
Seq2SeqMultipackBatchSampler (multipack_seq2seq.py); lorakit.data.batching picks one for a recipe.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# Batches are formed within windows of this many batches per rank: long enough that each window holds
# a spread of lengths to sort, short enough that the order still looks shuffled to the optimizer.
WINDOW_BATCHES = 64


def check_rank(rank: int, num_replicas: int) -> None:
    """Refuse a rank outside [0, num_replicas)."""
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside num_replicas {num_replicas}")


def positive_int(value, name: str) -> int:
    """`value` as an int; refuses bools, fractions and values below 1, naming `name`."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def length_array(lengths: Sequence[int], name: str = "lengths") -> np.ndarray:
    """`lengths` as a flat int64 array; refuses other shapes, no examples and non-integral values."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence, got shape {arr.shape}")
    if len(arr) == 0:
        raise ValueError("no examples to batch")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def target_array(target_lengths: Sequence[int], lengths: np.ndarray) -> np.ndarray:
    """`target_lengths` as an int array, one per example of `lengths`."""
    targets = length_array(target_lengths, "target_lengths")
    if targets.shape != lengths.shape:
        raise ValueError(f"{len(targets)} target lengths for {len(lengths)} examples")
    return targets


def check_within(lengths: np.ndarray, cap: int, name: str, setting: str) -> None:
    """Refuse an example shorter than 1 token or longer than `cap` (the `setting` it comes from): a
    micro-batch must hold any one example."""
    bad = np.flatnonzero((lengths < 1) | (lengths > cap))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"example {i} has {name} {int(lengths[i])}, outside [1, {setting}={cap}]; truncate or drop "
            "over-long examples before batching"
        )


class Shard:
    """What every sampler knows of its place: rank of num_replicas, seed and epoch. Each epoch's order is
    a pure function of (seed, epoch), the same on every rank, which is what lets ranks agree without talking
    and a resumed run skip by number."""

    num_replicas: int
    rank: int
    seed: int
    epoch: int

    def _shard(self, num_replicas: int, rank: int, seed: int) -> None:
        check_rank(rank, num_replicas)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for `epoch`."""
        self.epoch = epoch

    def _rng(self) -> np.random.Generator:
        """This epoch's random stream (the same on every rank)."""
        return np.random.default_rng((self.seed, self.epoch))


class SlotDeal(Shard):
    """all_batches() and iteration for samplers that deal an epoch as `_slots()`: (the dataset index in every
    slot, the micro-batch of step j on rank r as [j, r]), cut into micro-batches by `_batches`; a rank
    builds only its own."""

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _batches(self, slots: np.ndarray, batches: np.ndarray) -> list[list[int]]:
        raise NotImplementedError

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i]."""
        slots, batches = self._slots()
        return [self._batches(slots, batches[:, r]) for r in range(self.num_replicas)]

    def __iter__(self) -> Iterator[list[int]]:
        slots, batches = self._slots()
        return iter(self._batches(slots, batches[:, self.rank]))


class LengthGroupedBatchSampler(Shard):
    """Yields this rank's micro-batches (lists of dataset indices) of examples with similar lengths.

    Padding to the longest member of a batch then wastes little (with group_by_length=False, batches are
    consecutive slices of a random permutation: what a plain shuffled DataLoader gives, kept for comparisons
    and as the steps of BalancedRandomBatchSampler). Each epoch is a deterministic shuffle
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
        self._shard(num_replicas, rank, seed)
        self.lengths = length_array(lengths)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.group_by_length = group_by_length
        group = batch_size * num_replicas
        n = len(self.lengths)
        self.total = (n // group) * group if drop_last else -(-n // group) * group
        if self.total == 0:
            raise ValueError(
                f"{n} examples cannot fill one batch of {batch_size} on each of {num_replicas} ranks with drop_last"
            )
        self.dropped = max(n - self.total, 0)

    def __len__(self) -> int:
        return self.total // (self.batch_size * self.num_replicas)

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i]."""
        rng = self._rng()
        order = rng.permutation(len(self.lengths))
        if self.total > len(order):
            order = np.concatenate([order, order[: self.total - len(order)]])
        order = order[: self.total]
        group = self.batch_size * self.num_replicas
        window = group * WINDOW_BATCHES
        groups = []
        for start in range(0, self.total, window):
            chunk = order[start : start + window]
            if self.group_by_length:
                # Stable sort, longest first, so batches of a window hold neighbours in length.
                chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            groups.extend(chunk[i : i + group] for i in range(0, len(chunk), group))
        if self.group_by_length:
            rng.shuffle(groups)
        # Random batches are consecutive slices of the epoch's permutation, as a shuffled DataLoader takes
        # them: an optimizer step then holds the same examples however it is split into micro-batches.
        per_rank: list[list[list[int]]] = [[] for _ in range(self.num_replicas)]
        for g in groups:
            # The ranks of one step share a group of similar lengths, so no rank waits on a longer batch.
            for r in range(self.num_replicas):
                per_rank[r].append(g[r * self.batch_size : (r + 1) * self.batch_size].tolist())
        return per_rank

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.rank])


class SideFills:
    """efficiency() and target_efficiency() for samplers that measure both sides (source, target) per
    epoch: `_measure_sides`, cached until the epoch changes."""

    _fills: tuple[int, float, float | None] | None = None

    def _measure_sides(self) -> list[float | None]:
        raise NotImplementedError

    def _fill(self) -> tuple[float, float | None]:
        if self._fills is None or self._fills[0] != self.epoch:
            source, target = self._measure_sides()
            self._fills = (self.epoch, source, target)
        return self._fills[1], self._fills[2]

    def efficiency(self) -> float:
        """How much of the current epoch's source rows is real work (see `_measure_sides`)."""
        return self._fill()[0]

    def target_efficiency(self) -> float:
        """As efficiency(), for the targets (the decoder side); only with target_lengths."""
        fill = self._fill()[1]
        if fill is None:
            raise ValueError("target_efficiency() needs target_lengths")
        return fill


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
