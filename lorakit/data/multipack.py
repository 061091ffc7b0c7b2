"""Multipack: micro-batches that each fill one packed row of at most `max_tokens` tokens.

Examples of equal length are interchangeable for packing, so bins are packed once, on the histogram of
lengths (best-fit decreasing over length classes, moving whole groups of identical bins at a time), which
takes milliseconds for a million examples. The result is a fixed set of bins, each a multiset of lengths
("slots"). Every epoch, the examples of each length are shuffled into that length's slots and the bins
are reordered, both with numpy, so the per-epoch work is a permutation and a sort.

Ranks run one micro-batch each per step, so the bin count is made a multiple of `num_replicas` (by
re-spreading the cheapest bins over a few more bins, or with drop_last by dropping the bins that hold the
fewest examples), and the bins of one step are neighbours in cost, so no rank waits long on another.
"""

from __future__ import annotations

import gc
import heapq
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Sequence

import numpy as np

from lorakit.data.sampler import SlotDeal, check_within, length_array, positive_int

# A bin's content: (length, how many examples of that length), longest first.
Content = tuple[tuple[int, int], ...]

# How many more step-groups of the cheapest bins to try re-spreading before splitting bins one at a time,
# and the most examples to re-spread in Python (bins of thousands of one-token examples would be slow).
_REBALANCE_TRIES = 4
_REBALANCE_MAX_EXAMPLES = 100_000


def _pack_histogram(counts: np.ndarray, max_tokens: int) -> list[list]:
    """Best-fit decreasing on a histogram of lengths: [content, number of identical bins] groups.

    Exact BFD puts each item into the open bin with the least room that still fits it. That bin then has
    even less room, so it keeps taking items of the same length until full; the next bin of the same room
    follows. So all bins of one room class take the same number of items at once and stay identical.
    """
    by_room: dict[int, list[list]] = {}
    rooms: list[int] = []  # sorted keys of by_room

    def add(room: int, content: Content, n: int) -> None:
        groups = by_room.get(room)
        if groups is None:
            by_room[room] = [[content, n]]
            insort(rooms, room)
        else:
            groups.append([content, n])

    for length in np.flatnonzero(counts)[::-1].tolist():
        left = int(counts[length])
        while left:
            i = bisect_left(rooms, length)
            if i == len(rooms):
                per_bin = max_tokens // length
                full, rest = divmod(left, per_bin)
                if full:
                    add(max_tokens - per_bin * length, ((length, per_bin),), full)
                if rest:
                    add(max_tokens - rest * length, ((length, rest),), 1)
                break
            room = rooms[i]
            groups = by_room[room]
            content, n = groups[-1]
            per_bin = room // length
            moves = []
            full = min(n, left // per_bin)
            if full:
                moves.append((room - per_bin * length, content + ((length, per_bin),), full))
                n -= full
                left -= full * per_bin
            if n and left:  # fewer than per_bin left: one more bin takes them all
                moves.append((room - left * length, content + ((length, left),), 1))
                n -= 1
                left = 0
            if n:
                groups[-1][1] = n
            else:
                groups.pop()
                if not groups:
                    del by_room[room]
                    rooms.pop(i)
            for move in moves:
                add(*move)
    return [g for room in rooms for g in by_room[room]]


def steps_lightest_last(rng: np.random.Generator, steps: int, lightest: int) -> np.ndarray:
    """A random order of `steps` steps with `lightest` moved to the end, where a DataLoader puts its partial
    batch: mid-epoch, a step of a few examples is an update at full learning rate; at the end of a decaying
    schedule it is not. Both multipack samplers order their steps this way."""
    order = rng.permutation(steps)
    return np.append(order[order != lightest], lightest)


def _content(lengths: Sequence[int]) -> Content:
    return tuple(sorted(Counter(lengths).items(), reverse=True))


def _expand(content: Content) -> list[int]:
    return [length for length, k in content for _ in range(k)]


class MultipackBatchSampler(SlotDeal):
    """Yields this rank's micro-batches (lists of dataset indices) whose lengths sum to <= `max_tokens`.

    Each micro-batch is meant to become one packed row. The bins are packed once, so `len(self)` is exact
    and the same on every rank and every epoch; each epoch deterministically reshuffles, from (seed, epoch),
    which examples of a length fill which slots and the order of the steps. Without drop_last every example
    is used exactly once per epoch; with it, the bins that do not fill a step on every rank are dropped
    (those holding the fewest examples), and `dropped` counts their examples, the same every epoch.

    A micro-batch's cost is modelled as tokens + sum(length**2) / `quadratic_scale`: attention is quadratic
    within each example. `quadratic_scale` is the length at which an example spends as much on attention as
    on everything else, roughly 6-12x the hidden size.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        quadratic_scale: float = 16384.0,
    ):
        self._shard(num_replicas, rank, seed)
        max_tokens = positive_int(max_tokens, "max_tokens")
        if quadratic_scale <= 0:
            raise ValueError(f"quadratic_scale must be positive, got {quadratic_scale!r}")
        self.lengths = length_array(lengths)
        check_within(self.lengths, max_tokens, "length", "max_tokens")
        self.max_tokens, self.drop_last = max_tokens, drop_last
        self.quadratic_scale = float(quadratic_scale)

        n = len(self.lengths)
        counts = np.bincount(self.lengths)
        groups = _pack_histogram(counts, max_tokens)
        groups = self._fit_replicas(groups, n)
        groups.sort(key=lambda g: (self._cost(g[0]), g[0]))

        # Slots, bin after bin in ascending cost; step j runs bins [j*R, (j+1)*R), one per rank.
        patterns = [np.repeat([L for L, _ in c], [k for _, k in c]) for c, _ in groups]
        slot_len = np.concatenate([np.tile(p, m) for p, (_, m) in zip(patterns, groups, strict=True)])
        bin_items = np.repeat([len(p) for p in patterns], [m for _, m in groups])
        self._bin_items = bin_items
        self._bin_starts = np.cumsum(bin_items) - bin_items
        self._num_bins = len(bin_items)
        step_tokens = np.add.reduceat(slot_len, self._bin_starts).reshape(-1, num_replicas).sum(axis=1)
        self._lightest_step = int(step_tokens.argmin())
        # Small keys let numpy's stable sort use radix sort in the per-epoch shuffle.
        self._keys = self.lengths.astype(np.uint16 if len(counts) <= 2**16 else np.uint32)
        self._slot_by_len = np.argsort(slot_len, kind="stable")
        used = np.bincount(slot_len, minlength=len(counts))
        self.dropped = n - len(slot_len)
        # Which positions of the length-sorted epoch order fill a slot: the first used[L] of each length.
        self._take = None
        if self.dropped:
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            self._take = np.repeat(starts - np.concatenate([[0], np.cumsum(used)[:-1]]), used)
            self._take += np.arange(len(slot_len))
        self._efficiency = float(slot_len.sum()) / (max_tokens * self._num_bins)

    def _cost(self, content: Content) -> float:
        return sum(L * k for L, k in content) + sum(L * L * k for L, k in content) / self.quadratic_scale

    def _fit_replicas(self, groups: list[list], n: int) -> list[list]:
        """Make the bin count a multiple of num_replicas without repeating examples."""
        replicas = self.num_replicas
        num_bins = sum(m for _, m in groups)
        groups.sort(key=lambda g: (self._cost(g[0]), g[0]))
        if self.drop_last:
            if num_bins < replicas:
                raise ValueError(
                    f"{n} examples pack into {num_bins} micro-batches of {self.max_tokens} tokens, fewer than "
                    f"num_replicas {replicas}; drop_last would drop them all"
                )
            # Drop the bins that hold the fewest examples (then the fewest tokens): the least data lost.
            groups.sort(key=lambda g: (sum(k for _, k in g[0]), sum(L * k for L, k in g[0]), g[0]))
            groups, _ = self._take_first(groups, num_bins % replicas)
            groups.sort(key=lambda g: (self._cost(g[0]), g[0]))
            return self._rebalance(groups, 0) or groups
        target = -(-num_bins // replicas) * replicas
        if n < replicas:
            raise ValueError(
                f"{n} examples are fewer than num_replicas {replicas}: every rank needs a micro-batch"
            )
        if target > n:
            raise ValueError(
                f"{n} examples pack into {num_bins} micro-batches; reaching a multiple of num_replicas "
                f"{replicas} would need {target}, more than one example each; use drop_last"
            )
        balanced = self._rebalance(groups, target - num_bins)
        if balanced is not None:
            return balanced
        return self._split(groups, target - num_bins)

    @staticmethod
    def _take_first(groups: list[list], k: int) -> tuple[list[list], list[Content]]:
        """Removes the first k bins of sorted groups; returns (rest, removed contents)."""
        taken: list[Content] = []
        rest = []
        for content, m in groups:
            t = min(m, k - len(taken))
            taken.extend([content] * t)
            if m > t:
                rest.append([content, m - t])
        return rest, taken

    def _rebalance(self, groups: list[list], extra: int) -> list[list] | None:
        """Re-spreads the cheapest bins over `extra` more bins, so the last steps' bins cost about the same.

        Those bins hold the packer's last, partly filled bin and its smallest examples, which spread
        evenly. Returns None if no try fits; with extra == 0, also if it would not improve the balance.
        """
        replicas = self.num_replicas
        if replicas == 1:
            return groups if extra == 0 else None
        num_bins = sum(m for _, m in groups)
        for tries in range(1, _REBALANCE_TRIES + 1):
            take = tries * replicas - extra
            if take > num_bins:
                break
            rest, taken = self._take_first(groups, take)
            if sum(k for c in taken for _, k in c) > _REBALANCE_MAX_EXAMPLES:
                break
            bins = self._spread([L for c in taken for L in _expand(c)], take + extra)
            if bins is None:
                continue
            new = [_content(b) for b in bins]
            if extra == 0:
                before = [self._cost(c) for c in taken]
                after = [self._cost(c) for c in new]
                if max(after) / min(after) >= max(before) / min(before):
                    return None
            merged = rest + [[c, 1] for c in new]
            merged.sort(key=lambda g: (self._cost(g[0]), g[0]))
            return merged
        return None

    def _spread(self, pool: list[int], num_bins: int) -> list[list[int]] | None:
        """Longest-first onto the cheapest bin with room: balanced bins, None if some example finds none."""
        if len(pool) < num_bins:
            return None
        # Empty bins cost 0, so the first num_bins examples each open their own bin: none stays empty.
        heap = [(0.0, 0, b) for b in range(num_bins)]
        bins: list[list[int]] = [[] for _ in range(num_bins)]
        for length in sorted(pool, reverse=True):
            full = []
            while heap and heap[0][1] + length > self.max_tokens:
                full.append(heapq.heappop(heap))
            if not heap:
                return None
            cost, tokens, b = heapq.heappop(heap)
            bins[b].append(length)
            heapq.heappush(heap, (cost + length + length * length / self.quadratic_scale, tokens + length, b))
            for item in full:
                heapq.heappush(heap, item)
        return bins

    def _split(self, groups: list[list], extra: int) -> list[list]:
        """Fallback: splits the bin with the most examples in two, `extra` times (the caller checked it can)."""
        groups = [list(g) for g in groups]
        for _ in range(extra):
            i = max(range(len(groups)), key=lambda j: sum(k for _, k in groups[j][0]))
            content = groups[i][0]
            groups[i][1] -= 1
            if groups[i][1] == 0:
                groups.pop(i)
            halves = self._spread(_expand(content), 2)
            assert halves is not None  # the halves of a bin that fit always fit
            groups.extend([_content(h), 1] for h in halves)
        return groups

    def __len__(self) -> int:
        return self._num_bins // self.num_replicas

    def efficiency(self) -> float:
        """Tokens used / token capacity of all ranks' micro-batches this epoch (the same every epoch)."""
        return self._efficiency

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index of every slot, bin index of step j on rank r as [j, r]) for this epoch."""
        rng = self._rng()
        perm = rng.permutation(len(self.lengths))
        # Grouped by length, random within a length: the examples of a length take its slots in this order.
        by_len = perm[np.argsort(self._keys[perm], kind="stable")]
        if self._take is not None:
            by_len = by_len[self._take]
        slots = np.empty(len(by_len), dtype=np.int64)
        slots[self._slot_by_len] = by_len
        steps = len(self)
        replicas = self.num_replicas
        # Shuffle the steps, the one of fewest tokens (best fit's partly filled bin) last; within a step
        # (bins of similar cost), which rank takes which bin.
        deal = np.argsort(rng.random((steps, replicas)), axis=1)
        bins = steps_lightest_last(rng, steps, self._lightest_step)[:, None] * replicas + deal
        return slots, bins

    def _batches(self, slots: np.ndarray, bins: np.ndarray) -> list[list[int]]:
        """One rank's micro-batches, `bins` in order: its slots gathered by numpy, then cut into lists."""
        sizes = self._bin_items[bins]
        ends = np.cumsum(sizes)
        gather = np.repeat(self._bin_starts[bins] - (ends - sizes), sizes) + np.arange(int(ends[-1]))
        flat = slots[gather].tolist()
        ends_list = ends.tolist()
        # Hundreds of thousands of new lists would trigger collection after collection, each scanning the
        # growing result; the lists hold only ints, so no cycles can form while collection is paused.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return [flat[a:b] for a, b in zip([0, *ends_list[:-1]], ends_list, strict=True)]
        finally:
            if was_enabled:
                gc.enable()
