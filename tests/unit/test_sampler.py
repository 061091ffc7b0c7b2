import numpy as np
import pytest

from lorakit.data.sampler import LengthGroupedBatchSampler


def _lengths(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4, 0.8, n).astype(int), 2, 600)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_example_once_and_equal_batches_per_rank(replicas):
    lengths = _lengths(1001)
    samplers = [
        LengthGroupedBatchSampler(lengths, 8, num_replicas=replicas, rank=r, seed=3) for r in range(replicas)
    ]
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(samplers[0])
    seen = [i for rank in batches for b in rank for i in b]
    assert set(seen) == set(range(1001))  # all used; padding repeats a few
    assert len(seen) - 1001 < 8 * replicas
    assert all(len(b) == 8 for rank in batches for b in rank)


def test_drop_last_reports_dropped():
    s = LengthGroupedBatchSampler(_lengths(100), 8, num_replicas=3, rank=0, drop_last=True)
    assert s.dropped == 100 - 96 and len(s) == 4
    all_idx = [i for r in s.all_batches() for b in r for i in b]
    assert len(all_idx) == len(set(all_idx)) == 96


def test_epochs_reshuffle_deterministically():
    lengths = _lengths()
    a = LengthGroupedBatchSampler(lengths, 8, seed=1)
    b = LengthGroupedBatchSampler(lengths, 8, seed=1)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)


def test_grouping_cuts_padding_and_balances_ranks():
    lengths = _lengths(4000)
    s = LengthGroupedBatchSampler(lengths, 8, num_replicas=2, seed=0)
    per_rank = s.all_batches()
    slots = sum(len(b) * lengths[b].max() for r in per_rank for b in r)
    real = sum(lengths[b].sum() for r in per_rank for b in r)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(lengths))
    random_batches = [order[i : i + 8] for i in range(0, len(order), 8)]
    random_slots = sum(len(b) * lengths[b].max() for b in random_batches)
    assert real / slots > 0.9 > lengths.sum() / random_slots
    # Ranks take batches of similar length at each step, so neither waits long for the other.
    for b0, b1 in zip(per_rank[0], per_rank[1], strict=True):
        assert (
            abs(int(lengths[b0].max()) - int(lengths[b1].max()))
            <= max(lengths[b0].max(), lengths[b1].max()) * 0.5
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        LengthGroupedBatchSampler([1, 2], 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="no examples"):
        LengthGroupedBatchSampler([], 1)


def test_random_batches_pad_more_than_grouped():
    lengths = _lengths(800)

    def slots(grouped: bool) -> int:
        s = LengthGroupedBatchSampler(lengths, 8, seed=1, group_by_length=grouped)
        batches = list(s)
        assert sorted(i for b in batches for i in b) == list(range(800))
        return sum(len(b) * int(lengths[b].max()) for b in batches)

    # Same examples either way; random batches pad to much longer members.
    assert slots(False) > 1.5 * slots(True)
