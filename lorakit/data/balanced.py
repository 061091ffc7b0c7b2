"""Packed rows of a fixed number of random examples, dealt so the ranks' rows are about equally long."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from lorakit.data.sampler import LengthGroupedBatchSampler, SideFills, positive_int, target_array


class BalancedRandomBatchSampler(SideFills):
    """Yields this rank's micro-batches of exactly `batch_size` random examples, for packed rows that keep
    the optimizer steps of a plain shuffled DataLoader.

    Each optimizer step (`accumulation` micro-batches on each of `num_replicas` ranks) holds exactly the
    examples that LengthGroupedBatchSampler(group_by_length=False) with the same seed puts in that step: a
    random set, drawn without regard to length, so every example weighs in the epoch as it does with random
    padded batches. Packing to a token budget instead makes the examples per step depend on their lengths
    (a step of long sources holds fewer of them; docs/packing.md). Inside a step, which micro-batch an
    example goes to does not change the step's gradient (the loss is token-weighted over the whole step on
    all ranks), so the step's examples are dealt again, largest first, each to the micro-batch with room
    whose fuller side (source or target tokens) stays lowest: the step's rows come out about equally long on
    both sides, and no rank waits on a longer row. Every micro-batch holds `batch_size` examples, so a row
    is never longer than `batch_size` x the longest example.

    Deterministic per (seed, epoch); `len()`, `dropped` and the repeats that fill the last batch are those of
    LengthGroupedBatchSampler; the epoch's last accumulation window may be shorter, as there.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        target_lengths: Sequence[int] | None = None,
        accumulation: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.accumulation = positive_int(accumulation, "accumulation")
        self.batch_size = positive_int(batch_size, "batch_size")
        self.random = LengthGroupedBatchSampler(
            lengths,
            self.batch_size,
            num_replicas=num_replicas,
            rank=rank,
            seed=seed,
            drop_last=drop_last,
            group_by_length=False,
        )
        self.lengths = self.random.lengths
        self.target_lengths = None
        self._cost = self.lengths
        if target_lengths is not None:
            self.target_lengths = target_array(target_lengths, self.lengths)
            self._cost = self.lengths + self.target_lengths
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.dropped = self.random.dropped
        # (epoch, every rank's batches): the deal is computed once per epoch, for efficiency() and iteration.
        self._dealt: tuple[int, list[list[list[int]]]] | None = None

    @property
    def epoch(self) -> int:
        return self.random.epoch

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for `epoch`."""
        self.random.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.random)

    def _deal(self, items: list[int], rows: int) -> list[list[int]]:
        """`items` in `rows` micro-batches of batch_size each: largest first, each to the micro-batch whose
        fuller side (source or target tokens, as shares of the step's mean row) stays lowest with it."""
        if rows == 1:
            return [items]
        idx = np.asarray(items, dtype=np.int64)

        def shares(lengths: np.ndarray) -> np.ndarray:
            x = lengths[idx]
            return x * rows / max(int(x.sum()), 1)

        a = shares(self.lengths)
        b = np.zeros(len(idx)) if self.target_lengths is None else shares(self.target_lengths)
        load_a, load_b = np.zeros(rows), np.zeros(rows)
        room = np.full(rows, self.batch_size)
        out: list[list[int]] = [[] for _ in range(rows)]
        for k in np.argsort(-(a + b), kind="stable").tolist():
            score = np.maximum(load_a + a[k], load_b + b[k]) + 1e-3 * (load_a + load_b)
            r = int(np.where(room > 0, score, np.inf).argmin())
            load_a[r] += a[k]
            load_b[r] += b[k]
            room[r] -= 1
            out[r].append(items[k])
        return out

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i] (kept for the epoch: not to be
        modified)."""
        if self._dealt is None or self._dealt[0] != self.epoch:
            self._dealt = (self.epoch, self._deal_epoch())
        return self._dealt[1]

    def _deal_epoch(self) -> list[list[list[int]]]:
        base = self.random.all_batches()
        world, n = self.num_replicas, len(self)
        out: list[list[list[int]]] = [[] for _ in range(world)]
        for start in range(0, n, self.accumulation):
            stop = min(start + self.accumulation, n)
            items = [i for r in range(world) for b in range(start, stop) for i in base[r][b]]
            rows = self._deal(items, (stop - start) * world)
            # Heaviest rows first, so the ranks of each micro-step take neighbours in size.
            rows.sort(key=lambda row: -int(self._cost[row].sum()))
            for k in range(stop - start):
                for r in range(world):
                    out[r].append(rows[k * world + r])
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.rank])

    def _measure_sides(self) -> list[float | None]:
        """Tokens / (ranks x the longest row of each micro-step), this epoch, per side: the rows are not
        padded, so this is the share of the ranks' row length not spent waiting for another rank's longer
        row (1.0 on one process)."""
        per_rank = self.all_batches()
        fills: list[float | None] = []
        for lengths in (self.lengths, self.target_lengths):
            if lengths is None:
                fills.append(None)
                continue
            tokens = np.array([[int(lengths[b].sum()) for b in rank] for rank in per_rank])
            fills.append(float(tokens.sum() / (tokens.max(axis=0).sum() * len(per_rank))))
        return fills
