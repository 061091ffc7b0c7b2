"""Length-grouped batches, sharded so every rank gets the same number of similar-length batches: a fixed
number of examples per micro-batch (LengthGroupedBatchSampler), or as many as a token budget allows
(TokenBudgetBatchSampler)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

# Batches are formed within windows of this many batches per rank: long enough that each window holds
# a spread of lengths to sort, short enough that the order still looks shuffled to the optimizer.
_WINDOW_BATCHES = 64
# The token-budget plan's random stream: an entry no epoch's (seed, epoch) stream uses.
_PLAN_STREAM = 2**32 - 1


class LengthGroupedBatchSampler:
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


class _SideFills:
    """efficiency() and target_efficiency() for samplers that measure both sides per epoch
    (`_measure_sides`, cached until the epoch changes)."""

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


class BalancedRandomBatchSampler(_SideFills):
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
        self.accumulation = _positive_int(accumulation, "accumulation")
        self.batch_size = _positive_int(batch_size, "batch_size")
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
            self.target_lengths = _target_array(target_lengths, self.lengths)
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


# The share of its budget a token-budget micro-batch fills with real tokens on long-tailed lengths: 0.85 to
# 0.96 at 6 to 64 examples per micro-batch (lognormal sources and targets, measured), higher with more.
_BUDGET_FILL = 0.92


def token_budget_for_rows(
    rows: int, lengths: Sequence[int], target_lengths: Sequence[int] | None = None, *, max_length: int
) -> int:
    """A `max_tokens` under which TokenBudgetBatchSampler makes micro-batches of about `rows` examples on
    average, so an epoch keeps the micro-batches (and optimizer steps) of fixed batches of `rows`.

    It is rows x the mean length / _BUDGET_FILL. With targets (whose budget is then this times the data's
    target/source token ratio, multipack_seq2seq.default_max_target_tokens), a micro-batch is full when
    either side is, so both budgets grow by the mean over examples of max(source / mean source, target /
    mean target). Never below the longest length (any one example must fit), never above rows x
    `max_length`: a padded batch of `rows` at the length cap, the most that fixed batches could take.
    """
    src = np.asarray(lengths, dtype=np.float64)
    if len(src) == 0:
        raise ValueError("no examples to batch")
    spread = 1.0
    if target_lengths is not None:
        tgt = np.asarray(target_lengths, dtype=np.float64)
        spread = float(np.maximum(src / max(src.mean(), 1.0), tgt / max(tgt.mean(), 1.0)).mean())
    budget = math.ceil(rows * float(src.mean()) * spread / _BUDGET_FILL)
    return max(int(src.max()), min(rows * max_length, budget))


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _length_array(lengths: Sequence[int], name: str) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence, got shape {arr.shape}")
    if len(arr) and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _target_array(target_lengths: Sequence[int], lengths: np.ndarray) -> np.ndarray:
    """`target_lengths` as an int array, one per example of `lengths`."""
    targets = _length_array(target_lengths, "target_lengths")
    if targets.shape != lengths.shape:
        raise ValueError(f"{len(targets)} target lengths for {len(lengths)} examples")
    return targets


class TokenBudgetBatchSampler(_SideFills):
    """Yields this rank's micro-batches (lists of dataset indices) of similar-length examples, as many as a
    token budget allows: rows x longest length <= `max_tokens`, and with `target_lengths`, also rows x
    longest target <= `max_target_tokens` (fairseq's max_tokens batching). Short examples come many to a
    micro-batch and long ones few, so the padded size of every micro-batch stays within the budget.

    The two budgets are one: rows x max(cost) <= max_tokens x max_target_tokens, where an example's cost is
    max(source x max_target_tokens, target x max_tokens). The micro-batches' shapes (rows, largest cost
    allowed) are planned once, from `seed`: windows of a shuffle (each about _WINDOW_BATCHES micro-batches
    per rank) are sorted by cost and cut greedily, longest first, as LengthGroupedBatchSampler cuts its
    windows. So `len(self)` is exact, the same on every rank and the same every epoch: the LR schedule,
    built from it once before the first epoch, holds for all of them. The count is made a multiple of
    `num_replicas` by halving the micro-batches with the most rows; only when every micro-batch holds a
    single example are examples repeated instead (the first ones of the epoch's shuffle, `repeated` of
    them, as torch's DistributedSampler pads). No example is dropped (`dropped` is 0): each is used exactly
    once per epoch.

    Each epoch, from (seed, epoch), the examples are dealt into the shapes at random among those that fit:
    the windows overlap in length, so an example's neighbours change from epoch to epoch while every
    micro-batch keeps within its planned cost (a dataset within one window is sorted whole, and then only
    examples of equal cost trade places, as in LengthGroupedBatchSampler). The steps are then shuffled; the
    ranks of one step take micro-batches of neighbouring planned cost, so no rank waits on a much longer
    one.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        target_lengths: Sequence[int] | None = None,
        max_target_tokens: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas {num_replicas}")
        if (target_lengths is None) != (max_target_tokens is None):
            raise ValueError("target_lengths and max_target_tokens are given together or not at all")
        self.max_tokens = _positive_int(max_tokens, "max_tokens")
        self.lengths = _length_array(lengths, "lengths")
        if len(self.lengths) == 0:
            raise ValueError("no examples to batch")
        sides = [("length", self.lengths, self.max_tokens, "max_tokens")]
        self.target_lengths = self.max_target_tokens = None
        if target_lengths is not None:
            self.max_target_tokens = _positive_int(max_target_tokens, "max_target_tokens")
            self.target_lengths = _target_array(target_lengths, self.lengths)
            sides = [
                ("source length", self.lengths, self.max_tokens, "max_tokens"),
                ("target length", self.target_lengths, self.max_target_tokens, "max_target_tokens"),
            ]
        for name, x, cap, setting in sides:
            bad = np.flatnonzero((x < 1) | (x > cap))
            if len(bad):
                i = int(bad[0])
                raise ValueError(
                    f"example {i} has {name} {int(x[i])}, outside [1, {setting}={cap}]; cap or drop "
                    "over-long examples before batching"
                )
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        if self.target_lengths is None:
            self._cost, self._budget = self.lengths, self.max_tokens
        else:
            self._cost = np.maximum(
                self.lengths * self.max_target_tokens, self.target_lengths * self.max_tokens
            )
            self._budget = self.max_tokens * self.max_target_tokens
        caps, rows = self._plan()
        caps, rows, self.repeated = self._fit_replicas(caps, rows)
        # Ascending planned cost: step j runs micro-batches [j*R, (j+1)*R), neighbours in cost.
        order = np.lexsort((rows, caps))
        self._rows = rows[order]
        self._slot_cap = np.repeat(caps[order], self._rows)
        self._ends = np.cumsum(self._rows)
        self._starts = self._ends - self._rows
        self.dropped = 0

    def _plan(self) -> tuple[np.ndarray, np.ndarray]:
        """(largest cost allowed, rows) of every micro-batch: windows of a seed-determined shuffle, each
        sorted by cost and cut greedily, longest first (the fewest micro-batches for that window)."""
        rng = np.random.default_rng((self.seed, _PLAN_STREAM))
        cost = self._cost[rng.permutation(len(self._cost))]
        window = _WINDOW_BATCHES * self.num_replicas * self._budget
        total = np.cumsum(cost)
        cuts = np.searchsorted(total, np.arange(window, int(total[-1]), window), side="right")
        caps: list[int] = []
        rows: list[int] = []
        for chunk in np.split(cost, cuts):
            chunk = np.sort(chunk)[::-1].tolist()
            p = 0
            while p < len(chunk):
                take = min(self._budget // chunk[p], len(chunk) - p)
                caps.append(chunk[p])
                rows.append(take)
                p += take
        return np.asarray(caps, dtype=np.int64), np.asarray(rows, dtype=np.int64)

    def _fit_replicas(self, caps: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Make the micro-batch count a multiple of num_replicas: halve the ones with the most rows (both
        halves keep the cap, so they fit), else add single-example ones that repeat examples."""
        caps, rows = caps.tolist(), rows.tolist()
        extra = -len(rows) % self.num_replicas
        while extra:
            i = max(range(len(rows)), key=rows.__getitem__)
            if rows[i] < 2:
                break
            half = rows[i] // 2
            rows[i] -= half
            caps.append(caps[i])
            rows.append(half)
            extra -= 1
        # Any one example fits a micro-batch alone.
        caps += [self._budget] * extra
        rows += [1] * extra
        return np.asarray(caps, dtype=np.int64), np.asarray(rows, dtype=np.int64), extra

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for `epoch`."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self._rows) // self.num_replicas

    def _deal(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index in every slot, micro-batch of step j on rank r as [j, r]) for this epoch.

        Slots are in ascending order of their micro-batch's cap; examples, in ascending cost with ties in
        random order, are the i-th at most as costly as slot i (the plan is one such assignment). Example
        i gets a random key in [lo_i, i + 1), lo_i being the first slot whose cap holds it, and the slots
        are filled in key order. The lo_i examples before lo_i have keys below lo_i, so example i lands in
        a slot at or after lo_i: one whose cap holds it. Examples move only towards slots they fit.
        """
        rng = np.random.default_rng((self.seed, self.epoch))
        perm = rng.permutation(len(self._cost))
        pool = np.concatenate([perm, perm[: self.repeated]])
        ranked = pool[np.argsort(self._cost[pool], kind="stable")]
        lo = np.searchsorted(self._slot_cap, self._cost[ranked], side="left")
        keys = lo + rng.random(len(ranked)) * (np.arange(1, len(ranked) + 1) - lo)
        slots = ranked[np.argsort(keys, kind="stable")]
        steps, replicas = len(self), self.num_replicas
        deal = np.argsort(rng.random((steps, replicas)), axis=1)
        return slots, rng.permutation(steps)[:, None] * replicas + deal

    def _batches(self, slots: np.ndarray, batches: np.ndarray) -> list[list[int]]:
        flat = slots.tolist()
        starts, ends = self._starts.tolist(), self._ends.tolist()
        return [flat[starts[b] : ends[b]] for b in batches.tolist()]

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i]."""
        slots, batches = self._deal()
        return [self._batches(slots, batches[:, r]) for r in range(self.num_replicas)]

    def __iter__(self) -> Iterator[list[int]]:
        slots, batches = self._deal()
        return iter(self._batches(slots, batches[:, self.rank]))

    def _measure_sides(self) -> list[float | None]:
        """Real tokens / (rows x longest) summed over all ranks' micro-batches of the current epoch, per
        side: the share of the padded batches that is not padding. It moves a little from epoch to epoch as
        examples trade places (without targets, never below the fill of the planned shapes, since no
        micro-batch's longest example exceeds its planned one)."""
        slots, _ = self._deal()
        fills: list[float | None] = []
        for lengths in (self.lengths, self.target_lengths):
            if lengths is None:
                fills.append(None)
                continue
            x = lengths[slots]
            padded = int((np.maximum.reduceat(x, self._starts) * self._rows).sum())
            fills.append(int(x.sum()) / padded)
        return fills


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
