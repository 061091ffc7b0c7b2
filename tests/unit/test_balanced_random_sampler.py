"""BalancedRandomBatchSampler: packed rows of micro_batch_size random examples whose optimizer steps are
exactly those of random padded batches, with each step's rows balanced in tokens."""

import numpy as np
import pytest

from lorakit.data.balanced import BalancedRandomBatchSampler
from lorakit.data.sampler import LengthGroupedBatchSampler


def _long_tailed(n, seed=0):
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(100), 0.6, n).astype(int), 5, 600)
    tgt = np.clip(rng.lognormal(np.log(20), 0.5, n).astype(int), 2, 100)
    return src, tgt


def _steps(per_rank, accumulation):
    n = len(per_rank[0])
    return [
        sorted(i for rank in per_rank for batch in rank[s : s + accumulation] for i in batch)
        for s in range(0, n, accumulation)
    ]


@pytest.mark.parametrize(
    ("world", "accumulation", "n"), [(1, 1, 2003), (2, 3, 2003), (4, 2, 999), (3, 4, 64)]
)
def test_every_step_holds_the_examples_of_random_padded_batches(world, accumulation, n):
    src, tgt = _long_tailed(n)
    for epoch in (0, 1):
        s = BalancedRandomBatchSampler(
            src, 8, target_lengths=tgt, accumulation=accumulation, num_replicas=world, seed=5
        )
        padded = LengthGroupedBatchSampler(src, 8, num_replicas=world, seed=5, group_by_length=False)
        s.set_epoch(epoch)
        padded.set_epoch(epoch)
        assert len(s) == len(padded) and s.dropped == padded.dropped
        assert _steps(s.all_batches(), accumulation) == _steps(padded.all_batches(), accumulation)
        # Each rank iterates its own share, every micro-batch exactly batch_size examples.
        for rank in range(world):
            mine = BalancedRandomBatchSampler(
                src, 8, target_lengths=tgt, accumulation=accumulation, num_replicas=world, rank=rank, seed=5
            )
            mine.set_epoch(epoch)
            batches = list(mine)
            assert batches == s.all_batches()[rank]
            assert all(len(b) == 8 for b in batches)


def test_every_example_once_per_epoch_and_epochs_differ():
    src, tgt = _long_tailed(2048)
    s = BalancedRandomBatchSampler(src, 8, target_lengths=tgt, accumulation=2, num_replicas=2, seed=1)
    seen = [sorted(i for rank in s.all_batches() for b in rank for i in b)]
    first = s.all_batches()
    s.set_epoch(1)
    seen.append(sorted(i for rank in s.all_batches() for b in rank for i in b))
    assert seen[0] == seen[1] == list(range(2048))
    assert s.all_batches() != first
    s.set_epoch(0)
    assert s.all_batches() == first  # deterministic per (seed, epoch)


def test_composition_does_not_depend_on_length():
    # Token-budget rows hold fewer long examples per step; these steps do not: every step has batch_size x
    # accumulation x ranks examples, and a long example shares its step with as many others as a short one.
    src, tgt = _long_tailed(4096, seed=3)
    s = BalancedRandomBatchSampler(src, 8, target_lengths=tgt, accumulation=4, num_replicas=1, seed=0)
    steps = _steps(s.all_batches(), 4)
    assert {len(x) for x in steps} == {32}
    mean_src = [float(src[x].mean()) for x in steps]
    # Step means scatter around the data's mean as random draws of 32 do (no step is built from long ones).
    assert abs(np.mean(mean_src) - src.mean()) < 2
    assert np.std(mean_src) == pytest.approx(src.std() / np.sqrt(32), rel=0.25)


@pytest.mark.parametrize(("world", "accumulation"), [(2, 1), (4, 2), (8, 4)])
def test_rows_of_a_step_are_balanced_on_both_sides(world, accumulation):
    src, tgt = _long_tailed(4096, seed=1)
    s = BalancedRandomBatchSampler(
        src, 8, target_lengths=tgt, accumulation=accumulation, num_replicas=world, seed=2
    )
    padded = LengthGroupedBatchSampler(src, 8, num_replicas=world, seed=2, group_by_length=False)

    def fill(per_rank, lengths):
        tokens = np.array([[lengths[b].sum() for b in rank] for rank in per_rank])
        return tokens.sum() / (tokens.max(axis=0).sum() * world)

    assert s.efficiency() == pytest.approx(fill(s.all_batches(), src))
    assert s.target_efficiency() == pytest.approx(fill(s.all_batches(), tgt))
    # The same random steps dealt as they come leave ranks waiting on longer rows.
    assert s.efficiency() >= 0.95 and s.target_efficiency() >= 0.95
    assert fill(padded.all_batches(), src) < 0.92 and fill(padded.all_batches(), tgt) < 0.92
    # A row never holds more than batch_size examples, so it is never longer than batch_size x the longest.
    for rank in s.all_batches():
        assert max(int(src[b].sum()) for b in rank) <= 8 * int(src.max())


def test_one_process_is_fully_efficient_and_sources_alone_work():
    src, tgt = _long_tailed(100)
    s = BalancedRandomBatchSampler(src, 8, target_lengths=tgt, accumulation=3)
    assert s.efficiency() == s.target_efficiency() == 1.0
    only_sources = BalancedRandomBatchSampler(src, 8, accumulation=3, num_replicas=2)
    assert only_sources.efficiency() > 0.9
    with pytest.raises(ValueError, match="needs target_lengths"):
        only_sources.target_efficiency()


def test_bad_arguments_are_refused():
    src, tgt = _long_tailed(50)
    with pytest.raises(ValueError, match="accumulation must be a positive integer"):
        BalancedRandomBatchSampler(src, 8, accumulation=0)
    with pytest.raises(ValueError, match="target lengths for 50 examples"):
        BalancedRandomBatchSampler(src, 8, target_lengths=tgt[:10])
    with pytest.raises(ValueError, match="outside num_replicas"):
        BalancedRandomBatchSampler(src, 8, num_replicas=2, rank=2)


def test_a_step_holds_the_same_examples_however_it_is_split():
    # Random steps are slices of the epoch's permutation: 4 micro-batches of 8 and 1 of 32 (or 2 ranks x 2
    # of 8) train on the same 32 examples per step, so packing rows of 32 changes no step of an 8 x 4 recipe.
    src, tgt = _long_tailed(992, seed=4)
    steps = []
    for batch, accumulation, world in ((8, 4, 1), (32, 1, 1), (8, 2, 2), (16, 2, 1)):
        s = BalancedRandomBatchSampler(
            src, batch, target_lengths=tgt, accumulation=accumulation, num_replicas=world, seed=9
        )
        s.set_epoch(2)
        steps.append(_steps(s.all_batches(), accumulation))
        padded = LengthGroupedBatchSampler(src, batch, num_replicas=world, seed=9, group_by_length=False)
        padded.set_epoch(2)
        assert _steps(padded.all_batches(), accumulation) == steps[-1]
    assert all(x == steps[0] for x in steps)
