"""Multipack for encoder-decoder examples: micro-batches under two capacities, source and target tokens.

Each micro-batch becomes one encoder row and one decoder row (lorakit.data.collate.PackedSeq2SeqCollator),
so a bin must respect both capacities. This is two-dimensional bin packing (`pack_pairs`): the lower bound
on the bin count is opened first and the examples, largest first, are dealt to the bin with the most room
where each needs it, so bins end with a mix of long and short examples that fills both rows; best fit
decreasing is tried too and kept when it needs fewer bins (rows of only a few examples). Open bins that
can no longer take even the smallest remaining example are retired from the search, which keeps it fast.
When the lower bound was too few, the examples are dealt again over the final bin count from the start, so
every bin is about equally full instead of the late ones holding only leftovers.

Bins are packed once, so `len()` is exact and the same every epoch. Which examples share a bin is not: each
epoch, from (seed, epoch), examples of neighbouring sizes trade bins at random wherever both bins stay within
both capacities (`_trade`), so every seed and every epoch trains on its own partition of the data into rows
(a fixed partition would put the same examples in one optimizer step every epoch); then the order of steps
and which rank takes which bin are shuffled, except that the least filled step goes last.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from lorakit.data.multipack import steps_lightest_last
from lorakit.data.sampler import Shard, check_within, length_array, target_array

# Retire full bins from the search every this many placements.
_COMPACT_EVERY = 256
# Spread-first packing works on chunks whose lower bound is about this many bins, so one placement scans
# at most a few hundred bins however large the dataset is.
_CHUNK_BINS = 512
# Best fit is tried only when spread-first used more bins than this times the lower bound.
_NEAR_LOWER_BOUND = 1.02
# Rounds of random trades between bins per epoch (see Seq2SeqMultipackBatchSampler._trade).
_TRADE_ROUNDS = 8
# Trading partners are drawn among this many neighbours in size order.
_TRADE_BLOCK = 16


def default_max_target_tokens(source_lengths, target_lengths, max_source_tokens: int) -> int:
    """A decoder capacity in the data's own target/source ratio (never below the longest target), so both
    rows of a packed pair fill equally."""
    src = np.asarray(source_lengths, dtype=np.float64)
    tgt = np.asarray(target_lengths, dtype=np.int64)
    ratio = float(tgt.sum()) / max(float(src.sum()), 1.0)
    return max(int(np.ceil(max_source_tokens * ratio)), int(tgt.max()))


def _place(
    a: np.ndarray, b: np.ndarray, cap_a: int, cap_b: int, opened: int, spread: bool
) -> list[list[int]]:
    """Place the examples in their order (largest first) into `opened` empty bins, opening more when none
    fits: spread, into the bin whose room is most aligned with the example (largest room_a * a_i / cap_a**2
    + room_b * b_i / cap_b**2), which deals the big examples out over all bins first; else best fit (the
    least room left in both dimensions together)."""
    n = len(a)
    room_a = np.full(n + opened, cap_a, dtype=np.int64)
    room_b = np.full(n + opened, cap_b, dtype=np.int64)
    ids = np.arange(n + opened)  # bin id of each active slot
    items: list[list[int]] = [[] for _ in range(opened)]
    active = opened
    wa, wb = a / (cap_a * cap_a), b / (cap_b * cap_b)
    # The smallest a and b among the examples still to place, for retiring bins that can take none.
    min_a = np.minimum.accumulate(a[::-1])[::-1]
    min_b = np.minimum.accumulate(b[::-1])[::-1]
    for i in range(n):
        ai, bi = int(a[i]), int(b[i])
        ra, rb = room_a[:active], room_b[:active]
        fits = (ra >= ai) & (rb >= bi)
        if fits.any():
            if spread:
                j = int(np.where(fits, ra * wa[i] + rb * wb[i], -1.0).argmax())
            else:
                j = int(np.where(fits, ra / cap_a + rb / cap_b, np.inf).argmin())
        else:
            j = active
            active += 1
            room_a[j], room_b[j], ids[j] = cap_a, cap_b, len(items)
            items.append([])
        room_a[j] -= ai
        room_b[j] -= bi
        items[ids[j]].append(i)
        if i % _COMPACT_EVERY == _COMPACT_EVERY - 1 and i + 1 < n:
            keep = (room_a[:active] >= min_a[i + 1]) & (room_b[:active] >= min_b[i + 1])
            k = int(keep.sum())
            room_a[:k], room_b[:k], ids[:k] = room_a[:active][keep], room_b[:active][keep], ids[:active][keep]
            active = k
    return [x for x in items if x]


def pack_pairs(a: np.ndarray, b: np.ndarray, cap_a: int, cap_b: int) -> list[list[int]]:
    """Two-dimensional bin packing: bins (lists of indices) with sum(a) <= cap_a and sum(b) <= cap_b.

    Examples are placed largest first, by the sum of their two sizes relative to the capacities.
    Spread-first opens the lower bound on the bin count (max(sum a / cap_a, sum b / cap_b)) and deals each
    example to the bin with the most room where it needs it, so every bin ends with a mix of long and short
    examples that fills both dimensions. Best fit alone packs the long sources together (bins full in source
    tokens only) and leaves the short ones for bins full in target tokens only: on the bundled news data,
    whose targets are all 21 to 25 tokens, it filled 86% of both rows at 1024 and 2048 tokens, spread-first
    96% and 97%. Best fit does better when a row holds only a few examples, so when spread-first ends more
    than 2% above the lower bound, best fit is tried too and the packing with fewer bins is kept.
    Large datasets are packed in chunks of about _CHUNK_BINS bins, each taking every k-th example
    of the size order (so every chunk has the same mix of sizes), which bounds the bins one placement scans.
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    order = np.lexsort((-a, -(a / cap_a + b / cap_b)))
    per_bin = min(cap_a / max(float(a.mean()), 1.0), cap_b / max(float(b.mean()), 1.0))
    chunks = max(1, int(len(a) / (max(per_bin, 1.0) * _CHUNK_BINS)))
    bins: list[list[int]] = []
    for c in range(chunks):
        idx = order[c::chunks]
        ca, cb = a[idx], b[idx]
        lower = int(np.ceil(max(ca.sum() / cap_a, cb.sum() / cap_b)))
        local = _place(ca, cb, cap_a, cap_b, lower, spread=True)
        if len(local) > lower:
            # The bins opened late hold only the leftovers (one row a tenth full, as one optimizer step at
            # one row per step: a noisy full-learning-rate update). Dealt again over all of them from the
            # start, the same count of bins usually holds everything with every bin about equally full.
            even = _place(ca, cb, cap_a, cap_b, len(local), spread=True)
            local = even if len(even) == len(local) else local
        if len(local) > lower * _NEAR_LOWER_BOUND:
            best_fit = _place(ca, cb, cap_a, cap_b, 0, spread=False)
            local = best_fit if len(best_fit) < len(local) else local
        bins += [idx[x].tolist() for x in local]
    return bins


class Seq2SeqMultipackBatchSampler(Shard):
    """Yields this rank's micro-batches (lists of dataset indices) with sum(source lengths) <=
    `max_source_tokens` and sum(target lengths) <= `max_target_tokens`.

    Same contract as MultipackBatchSampler: every rank gets exactly `len()` micro-batches per epoch; every
    example is used exactly once per epoch (bins are split to make their count a multiple of the ranks),
    or with drop_last the remainder bins holding the fewest examples are dropped (`dropped`); the ranks of
    a step get bins of similar cost; `set_epoch` reshuffles deterministically.
    """

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        max_source_tokens: int,
        max_target_tokens: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        quadratic_scale: float = 16384.0,
    ):
        self._shard(num_replicas, rank, seed)
        a = length_array(source_lengths, "source_lengths")
        b = target_array(target_lengths, a)
        check_within(a, max_source_tokens, "source length", "max_source_tokens")
        check_within(b, max_target_tokens, "target length", "max_target_tokens")
        self.source_lengths, self.target_lengths = a, b
        self.max_source_tokens, self.max_target_tokens = int(max_source_tokens), int(max_target_tokens)
        self.quadratic_scale = float(quadratic_scale)
        bins = pack_pairs(a, b, self.max_source_tokens, self.max_target_tokens)
        bins = self._fit_replicas(bins, drop_last)
        self.dropped = len(a) - sum(len(x) for x in bins)
        bins.sort(key=self._cost)
        self._bins = bins

    def _cost(self, items: list[int]) -> float:
        a, b = self.source_lengths[items], self.target_lengths[items]
        return float(a.sum() + b.sum() + ((a * a).sum() + (b * b).sum()) / self.quadratic_scale)

    def _fit_replicas(self, bins: list[list[int]], drop_last: bool) -> list[list[int]]:
        r = self.num_replicas
        extra = -len(bins) % r
        if extra == 0:
            return bins
        if drop_last and len(bins) >= r:
            # Drop the bins that hold the fewest examples: the least data lost.
            bins.sort(key=len)
            return bins[len(bins) % r :]
        if len(self.source_lengths) < r:
            raise ValueError(f"{len(self.source_lengths)} examples are fewer than num_replicas {r}")
        for _ in range(extra):
            bins.sort(key=len)
            if len(bins[-1]) < 2:
                raise ValueError(
                    f"{len(self.source_lengths)} examples cannot make a multiple of num_replicas {r} "
                    "micro-batches without repeating one; use drop_last"
                )
            big = bins.pop()
            # Alternate by size, so the halves cost about the same; both fit since the whole did.
            big.sort(key=lambda i: -(self.source_lengths[i] + self.target_lengths[i]))
            bins += [big[0::2], big[1::2]]
        return bins

    def __len__(self) -> int:
        return len(self._bins) // self.num_replicas

    def efficiency(self) -> float:
        """Source tokens used / source capacity of all micro-batches (the same every epoch)."""
        used = sum(int(self.source_lengths[b].sum()) for b in self._bins)
        return used / (self.max_source_tokens * len(self._bins))

    def target_efficiency(self) -> float:
        """Target tokens used / target capacity of all micro-batches."""
        used = sum(int(self.target_lengths[b].sum()) for b in self._bins)
        return used / (self.max_target_tokens * len(self._bins))

    def _trade(self, rng: np.random.Generator) -> tuple[list[list[int]], np.ndarray]:
        """The packed bins with their examples traded at random (this epoch's partition), and how full each
        bin is (source share + target share of its capacities).

        Each round pairs every example with a random one among its neighbours in size order (source, then
        target) and, taking the pairs in random order, swaps the two between their bins whenever both bins
        stay within both capacities. Bin count and capacities are those of the packing; only who shares a
        bin changes."""
        sizes = np.array([len(x) for x in self._bins])
        bin_of = np.repeat(np.arange(len(self._bins)), sizes)
        members = np.concatenate([np.asarray(x, dtype=np.int64) for x in self._bins])
        a, b = self.source_lengths[members], self.target_lengths[members]
        room_a = (
            (self.max_source_tokens - np.bincount(bin_of, weights=a, minlength=len(sizes)))
            .astype(int)
            .tolist()
        )
        room_b = (
            (self.max_target_tokens - np.bincount(bin_of, weights=b, minlength=len(sizes)))
            .astype(int)
            .tolist()
        )
        for _ in range(_TRADE_ROUNDS):
            # Size order, then shuffled within blocks of _TRADE_BLOCK neighbours (block edges at a random
            # offset): partners are similar in size but not always the same two.
            order = np.lexsort((rng.random(len(members)), b, a))
            block = (np.arange(len(order)) + int(rng.integers(_TRADE_BLOCK))) // _TRADE_BLOCK
            order = order[np.lexsort((rng.random(len(order)), block))]
            pairs = order[: 2 * (len(order) // 2)].reshape(-1, 2)
            pairs = pairs[rng.permutation(len(pairs))]
            i, j = pairs[:, 0], pairs[:, 1]
            x, y = bin_of[i], bin_of[j]
            da, db = a[j] - a[i], b[j] - b[i]
            keep = x != y
            taken = []
            # Sequential, so every swap is checked against the rooms the swaps before it left.
            for k, bx, by, ka, kb in zip(
                np.flatnonzero(keep).tolist(), x[keep].tolist(), y[keep].tolist(), da[keep].tolist(),
                db[keep].tolist(), strict=True,
            ):  # fmt: skip
                if room_a[bx] >= ka and room_a[by] >= -ka and room_b[bx] >= kb and room_b[by] >= -kb:
                    room_a[bx] -= ka
                    room_a[by] += ka
                    room_b[bx] -= kb
                    room_b[by] += kb
                    taken.append(k)
            i, j = i[taken], j[taken]
            for arr in (members, a, b):
                arr[i], arr[j] = arr[j], arr[i].copy()
        ends = np.cumsum(sizes)
        bins = [members[e - n : e].tolist() for e, n in zip(ends.tolist(), sizes.tolist(), strict=True)]
        fill = (self.max_source_tokens - np.array(room_a)) / self.max_source_tokens
        fill += (self.max_target_tokens - np.array(room_b)) / self.max_target_tokens
        return bins, fill

    def all_batches(self) -> list[list[list[int]]]:
        """Every rank's batches for the current epoch: result[rank][i]."""
        rng = self._rng()
        bins, fill = self._trade(rng)
        r = self.num_replicas
        # The step (r consecutive bins) of least filled rows goes last. (One row per step of 32 examples
        # with its runt mid-epoch: eval loss +0.02.)
        light = int(fill.reshape(len(self), r).sum(axis=1).argmin())
        steps = steps_lightest_last(rng, len(self), light)
        deal = np.argsort(rng.random((len(self), r)), axis=1)
        out: list[list[list[int]]] = [[] for _ in range(r)]
        for step in steps.tolist():
            for rank in range(r):
                b = bins[step * r + int(deal[step, rank])]
                # Within a micro-batch the order of examples changes nothing but is shuffled anyway.
                out[rank].append([int(i) for i in rng.permutation(b)])
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.all_batches()[self.rank])
