import math
from collections import Counter

import numpy as np
import pytest

from lorakit.data.multipack_seq2seq import default_max_target_tokens
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.data.token_budget import TokenBudgetBatchSampler, token_budget_for_rows


def _lengths(n=2000, seed=0, cap=600):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4, 0.8, n).astype(int), 2, cap)


def _pairs(n=2000, seed=0):
    """Long-tailed source and target lengths, loosely correlated (as in summarization data)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 2))
    z[:, 1] = 0.5 * z[:, 0] + 0.87 * z[:, 1]
    return (
        np.clip(np.exp(5 + 0.6 * z[:, 0]).astype(int), 5, 1000),
        np.clip(np.exp(3 + 0.5 * z[:, 1]).astype(int), 2, 200),
    )


def _padded(lengths, batch) -> int:
    return len(batch) * int(lengths[batch].max())


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_budget_holds_on_both_sides_every_epoch(replicas):
    src, tgt = _pairs(1500)
    s = TokenBudgetBatchSampler(
        src, 2000, target_lengths=tgt, max_target_tokens=300, num_replicas=replicas, seed=4
    )
    for epoch in range(3):
        s.set_epoch(epoch)
        batches = [b for rank in s.all_batches() for b in rank]
        assert max(_padded(src, b) for b in batches) <= 2000
        assert max(_padded(tgt, b) for b in batches) <= 300
        # The budget is used: most micro-batches hold several examples and come close to one side's budget.
        full = [max(_padded(src, b) / 2000, _padded(tgt, b) / 300) for b in batches]
        assert np.median(full) > 0.85


def test_rows_follow_length():
    lengths = _lengths(3000)
    s = TokenBudgetBatchSampler(lengths, 1200)
    batches = list(s)
    assert max(_padded(lengths, b) for b in batches) <= 1200
    # Short examples come many to a micro-batch, long ones few.
    assert max(len(b) for b in batches if lengths[b].max() <= 20) >= 60
    assert max(len(b) for b in batches if lengths[b].max() >= 400) <= 3


@pytest.mark.parametrize(("n", "replicas"), [(2001, 1), (2001, 2), (2001, 3), (997, 4), (50, 7)])
def test_every_example_once_and_equal_exact_len_on_every_rank(n, replicas):
    lengths = _lengths(n, seed=n)
    samplers = [
        TokenBudgetBatchSampler(lengths, 900, num_replicas=replicas, rank=r, seed=2) for r in range(replicas)
    ]
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert [len(b) for b in per_rank] == [len(s) for s in samplers] == [len(samplers[0])] * replicas
        assert per_rank == samplers[0].all_batches()
        seen = [i for rank in per_rank for b in rank for i in b]
        assert sorted(seen) == list(range(n))
        assert all(b for rank in per_rank for b in rank)
    assert samplers[0].dropped == 0 and samplers[0].repeated == 0


def test_count_is_the_same_every_epoch():
    # Many windows (a small budget), so each epoch deals different examples together; the count stays.
    lengths = _lengths(20000, seed=5)
    s = TokenBudgetBatchSampler(lengths, 700, num_replicas=2, seed=1)
    counts = set()
    for epoch in range(4):
        s.set_epoch(epoch)
        counts.add(tuple(len(r) for r in s.all_batches()))
    assert counts == {(len(s), len(s))}


def test_deterministic_per_seed_and_epoch_and_reshuffled_across_epochs():
    # All lengths distinct, so no two examples trade places as equals: new neighbours come from the deal.
    lengths = np.random.default_rng(6).permutation(np.arange(1000, 11000))
    a = TokenBudgetBatchSampler(lengths, 40000, seed=1)
    b = TokenBudgetBatchSampler(lengths, 40000, seed=1)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    second = list(a)
    assert second != first
    b.set_epoch(1)
    assert list(b) == second
    assert list(TokenBudgetBatchSampler(lengths, 40000, seed=2)) != first
    # Not only the order: most micro-batches hold a different set of examples in the next epoch.
    same = {frozenset(x) for x in first} & {frozenset(x) for x in second}
    assert len(same) < 0.5 * len(first)


def test_fills_far_better_than_random_fixed_size_batches():
    lengths = _lengths(4000, seed=7)
    s = TokenBudgetBatchSampler(lengths, 8 * int(lengths.mean()) + 100, num_replicas=2, seed=0)
    batches = [b for rank in s.all_batches() for b in rank]
    fill = lengths.sum() / sum(_padded(lengths, b) for b in batches)
    assert s.efficiency() == pytest.approx(fill)
    mean_rows = len(lengths) / len(batches)
    assert 5 <= mean_rows <= 12
    order = np.random.default_rng(0).permutation(len(lengths))
    k = round(mean_rows)
    random_fill = lengths.sum() / sum(_padded(lengths, order[i : i + k]) for i in range(0, len(order), k))
    assert s.efficiency() > 0.95 > 0.6 > random_fill


def test_target_efficiency_measures_the_decoder_side():
    src, tgt = _pairs(3000, seed=8)
    s = TokenBudgetBatchSampler(src, 1600, target_lengths=tgt, max_target_tokens=240, num_replicas=2)
    s.set_epoch(1)
    batches = [b for rank in s.all_batches() for b in rank]
    assert s.efficiency() == pytest.approx(src.sum() / sum(_padded(src, b) for b in batches))
    assert s.target_efficiency() == pytest.approx(tgt.sum() / sum(_padded(tgt, b) for b in batches))
    assert s.efficiency() > 0.8 and s.target_efficiency() > 0.8
    with pytest.raises(ValueError, match="target_lengths"):
        TokenBudgetBatchSampler(src, 1600).target_efficiency()


def test_ranks_of_a_step_get_similar_lengths():
    lengths = _lengths(8000, seed=9)
    per_rank = TokenBudgetBatchSampler(lengths, 1000, num_replicas=2, seed=3).all_batches()
    gaps = [
        abs(int(lengths[a].max()) - int(lengths[b].max())) / max(lengths[a].max(), lengths[b].max())
        for a, b in zip(*per_rank, strict=True)
    ]
    assert np.percentile(gaps, 90) < 0.1 and np.mean(gaps) < 0.05


def test_an_example_over_a_budget_is_an_error_naming_it():
    lengths = _lengths(100)
    lengths[17] = 901
    with pytest.raises(ValueError, match=r"example 17 has length 901, outside \[1, max_tokens=900\]"):
        TokenBudgetBatchSampler(lengths, 900)
    src, tgt = _pairs(100)
    tgt[42] = 301
    with pytest.raises(ValueError, match=r"example 42 has target length 301.*max_target_tokens=300"):
        TokenBudgetBatchSampler(src, 2000, target_lengths=tgt, max_target_tokens=300)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        TokenBudgetBatchSampler([1, 2], 4, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="no examples"):
        TokenBudgetBatchSampler([], 4)
    with pytest.raises(ValueError, match="together"):
        TokenBudgetBatchSampler([1, 2], 4, target_lengths=[1, 1])
    with pytest.raises(ValueError, match="3 target lengths for 2 examples"):
        TokenBudgetBatchSampler([1, 2], 4, target_lengths=[1, 1, 1], max_target_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        TokenBudgetBatchSampler([1, 2], 0)


def test_single_example_batches_repeat_the_fewest_to_fill_every_rank():
    # Every example fills the budget alone, so no micro-batch can be halved: 5 examples on 2 ranks.
    s = TokenBudgetBatchSampler([8] * 5, 8, num_replicas=2)
    assert len(s) == 3 and s.repeated == 1
    seen = Counter(i for rank in s.all_batches() for b in rank for i in b)
    assert set(seen) == set(range(5)) and sorted(seen.values()) == [1, 1, 1, 1, 2]


def test_resumes_under_resumable_batch_sampler():
    lengths = _lengths(3000, seed=10)
    full = TokenBudgetBatchSampler(lengths, 800, num_replicas=2, rank=1, seed=5)
    full.set_epoch(2)
    expected = list(full)
    wrapped = ResumableBatchSampler(TokenBudgetBatchSampler(lengths, 800, num_replicas=2, rank=1, seed=5))
    assert len(wrapped) == len(expected) and wrapped.dropped == 0
    wrapped.set_epoch(2)
    wrapped.skip_next(7)
    assert list(wrapped) == expected[7:]
    assert list(wrapped) == expected  # the skip applies once


@pytest.mark.parametrize("rows", [8, 16, 32])
def test_default_budget_gives_about_rows_examples_per_micro_batch(rows):
    lengths = _lengths(6000, seed=11)
    budget = token_budget_for_rows(rows, lengths, max_length=600)
    assert 0.9 * rows <= len(lengths) / len(TokenBudgetBatchSampler(lengths, budget)) <= 1.1 * rows
    # Two sides: each budget grows by how far the larger share of an example exceeds the mean.
    src, tgt = _pairs(6000, seed=11)
    max_src = token_budget_for_rows(rows, src, tgt, max_length=1000)
    max_tgt = default_max_target_tokens(src, tgt, max_src)
    s = TokenBudgetBatchSampler(src, max_src, target_lengths=tgt, max_target_tokens=max_tgt)
    assert 0.9 * rows <= len(src) / len(s) <= 1.1 * rows
    assert max_src > token_budget_for_rows(rows, src, max_length=1000)


def test_default_budget_holds_the_longest_and_at_most_a_padded_batch():
    lengths = _lengths(1000, seed=12)
    assert token_budget_for_rows(1, lengths, max_length=600) == lengths.max()
    # Examples all at the cap: the fill allowance would exceed what 4 padded rows at the cap take.
    assert token_budget_for_rows(4, [600] * 10, max_length=600) == 4 * 600
    assert token_budget_for_rows(4, [300] * 10, max_length=600) == math.ceil(4 * 300 / 0.92)
