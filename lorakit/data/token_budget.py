"""Padded micro-batches sized by token budgets: as many similar-length examples as the budget allows."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lorakit.data.sampler import (
    WINDOW_BATCHES,
    SideFills,
    SlotDeal,
    check_within,
    length_array,
    positive_int,
    target_array,
)

# The plan's random stream: an entry no epoch's (seed, epoch) stream uses.
_PLAN_STREAM = 2**32 - 1

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


class TokenBudgetBatchSampler(SideFills, SlotDeal):
    """Yields this rank's micro-batches (lists of dataset indices) of similar-length examples, as many as a
    token budget allows: rows x longest length <= `max_tokens`, and with `target_lengths`, also rows x
    longest target <= `max_target_tokens` (fairseq's max_tokens batching). Short examples come many to a
    micro-batch and long ones few, so the padded size of every micro-batch stays within the budget.

    The two budgets are one: rows x max(cost) <= max_tokens x max_target_tokens, where an example's cost is
    max(source x max_target_tokens, target x max_tokens). The micro-batches' shapes (rows, largest cost
    allowed) are planned once, from `seed`: windows of a shuffle (each about WINDOW_BATCHES micro-batches
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
        self._shard(num_replicas, rank, seed)
        if (target_lengths is None) != (max_target_tokens is None):
            raise ValueError("target_lengths and max_target_tokens are given together or not at all")
        self.max_tokens = positive_int(max_tokens, "max_tokens")
        self.lengths = length_array(lengths)
        sides = [("length", self.lengths, self.max_tokens, "max_tokens")]
        self.target_lengths = self.max_target_tokens = None
        if target_lengths is not None:
            self.max_target_tokens = positive_int(max_target_tokens, "max_target_tokens")
            self.target_lengths = target_array(target_lengths, self.lengths)
            sides = [
                ("source length", self.lengths, self.max_tokens, "max_tokens"),
                ("target length", self.target_lengths, self.max_target_tokens, "max_target_tokens"),
            ]
        for name, x, cap, setting in sides:
            check_within(x, cap, name, setting)
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
        window = WINDOW_BATCHES * self.num_replicas * self._budget
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

    def __len__(self) -> int:
        return len(self._rows) // self.num_replicas

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index in every slot, micro-batch of step j on rank r as [j, r]) for this epoch.

        Slots are in ascending order of their micro-batch's cap; examples, in ascending cost with ties in
        random order, are the i-th at most as costly as slot i (the plan is one such assignment). Example
        i gets a random key in [lo_i, i + 1), lo_i being the first slot whose cap holds it, and the slots
        are filled in key order. The lo_i examples before lo_i have keys below lo_i, so example i lands in
        a slot at or after lo_i: one whose cap holds it. Examples move only towards slots they fit.
        """
        rng = self._rng()
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

    def _measure_sides(self) -> list[float | None]:
        """Real tokens / (rows x longest) summed over all ranks' micro-batches of the current epoch, per
        side: the share of the padded batches that is not padding. It moves a little from epoch to epoch as
        examples trade places (without targets, never below the fill of the planned shapes, since no
        micro-batch's longest example exceeds its planned one)."""
        slots, _ = self._slots()
        fills: list[float | None] = []
        for lengths in (self.lengths, self.target_lengths):
            if lengths is None:
                fills.append(None)
                continue
            x = lengths[slots]
            padded = int((np.maximum.reduceat(x, self._starts) * self._rows).sum())
            fills.append(int(x.sum()) / padded)
        return fills
