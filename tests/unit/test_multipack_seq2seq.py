import numpy as np
import pytest

from lorakit.data.multipack_seq2seq import Seq2SeqMultipackBatchSampler, default_max_target_tokens


def _pairs(n, seed=0):
    """Long-tailed sources (median ~200, capped at 512) and targets whose share of the source varies a lot."""
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(200), 0.9, n).astype(int), 4, 512)
    tgt = np.clip((src * rng.lognormal(np.log(0.12), 0.6, n)).astype(int) + 2, 2, 128)
    return src, tgt


@pytest.mark.parametrize("replicas", [1, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_capacities_coverage_and_equal_steps(replicas, drop_last):
    src, tgt = _pairs(1203, seed=replicas)
    cs, ct = 1024, 160
    samplers = [
        Seq2SeqMultipackBatchSampler(
            src, tgt, cs, ct, num_replicas=replicas, rank=r, seed=5, drop_last=drop_last
        )
        for r in range(replicas)
    ]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert all(len(b) == len(samplers[0]) for b in per_rank)
        assert per_rank[0] == samplers[0].all_batches()[0]
        seen = [i for b in per_rank for batch in b for i in batch]
        assert len(seen) == len(set(seen)) == 1203 - samplers[0].dropped
        if not drop_last:
            assert samplers[0].dropped == 0
        for b in per_rank:
            for batch in b:
                assert batch and src[batch].sum() <= cs and tgt[batch].sum() <= ct


def test_efficiency_on_long_tailed_pairs_and_determinism():
    src, tgt = _pairs(5000)
    ct = default_max_target_tokens(src, tgt, 2048)
    assert ct >= tgt.max()
    s = Seq2SeqMultipackBatchSampler(src, tgt, 2048, ct, num_replicas=8, seed=1)
    assert s.efficiency() >= 0.90 and s.target_efficiency() >= 0.90
    again = Seq2SeqMultipackBatchSampler(src, tgt, 2048, ct, num_replicas=8, seed=1)
    assert again.all_batches() == s.all_batches()
    first = s.all_batches()
    s.set_epoch(1)
    assert s.all_batches() != first


def test_ranks_of_a_step_get_similar_bins():
    src, tgt = _pairs(4000, seed=2)
    s = Seq2SeqMultipackBatchSampler(src, tgt, 2048, 300, num_replicas=4)
    batches = s.all_batches()
    ratios = []
    for step in zip(*batches, strict=True):
        tokens = [src[b].sum() + tgt[b].sum() for b in step]
        ratios.append(max(tokens) / min(tokens))
    assert np.mean(ratios) < 1.1


def test_refuses_overlong_and_impossible_splits():
    with pytest.raises(ValueError, match="example 1 has target length 50, outside"):
        Seq2SeqMultipackBatchSampler([3, 4], [5, 50], 100, 40)
    with pytest.raises(ValueError, match="fewer than num_replicas"):
        Seq2SeqMultipackBatchSampler([3], [5], 100, 40, num_replicas=2)
