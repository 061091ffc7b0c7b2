"""The packing contract for encoder-decoders: a packed (encoder row, decoder row) pair computes exactly what
each of its (source, target) examples computes alone, in the training configuration (train mode, gradient
checkpointing on, LoRA attached with a non-zero update), through ModelInputs.logits as the loop calls it."""

from __future__ import annotations

import pytest
import torch

from lorakit.data.collate import PackedSeq2SeqCollator, Seq2SeqCollator
from lorakit.doctor import contracts
from lorakit.model.loss import token_loss_sum
from lorakit.model.varlen import _CALL_COST, _buckets
from tests.conftest import (
    PACKING_BACKENDS,
    losses_and_grads,
    ready_for_contract,
    tiny_recipe_dict,
    training_config_model,
)

# (source, target) lengths; sources longer than T5's relative-attention max distance (128) on purpose, and
# examples close enough in size that varlen SDPA attends to them in padded groups (see the test below).
PAIRS = contracts.SEQ2SEQ_PAIRS
TOL = 1e-4


BACKENDS = PACKING_BACKENDS


def _model(cache_dir, tmp_path, backend: str):
    return training_config_model(cache_dir, tmp_path / "run", backend)


def _padded_and_packed(built) -> tuple:
    """The collators of one padded and one packed batch for the model's decoder start token."""
    start_id = built.model.config.decoder_start_token_id
    return Seq2SeqCollator(0, start_id), PackedSeq2SeqCollator(512, 128, start_id)


def _rows(seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, 2000, (s,), generator=gen).tolist(),
            "labels": torch.randint(3, 2000, (t,), generator=gen).tolist(),
        }
        for s, t in PAIRS
    ]


def _alone_and_packed(built, rows):
    start_id = built.model.config.decoder_start_token_id
    alone = []
    for r in rows:
        batch = Seq2SeqCollator(0, start_id)([r])
        logits = built.inputs.logits(built.model, batch, "cpu")
        alone.append((logits[0], token_loss_sum(logits, batch["labels"])))
    packed = PackedSeq2SeqCollator(512, 128, start_id)(rows)
    logits = built.inputs.logits(built.model, packed, "cpu")
    sliced, start = [], 0
    for r in rows:
        n = len(r["labels"])
        seg = logits[:, start : start + n]
        sliced.append((seg[0], token_loss_sum(seg, packed["labels"][:, start : start + n])))
        start += n
    return alone, sliced, packed


def test_pairs_exercise_grouped_attention():
    """Varlen SDPA pads groups of similar examples to one size (keys masked) and attends to each group in one
    call; PAIRS must make groups in every attention kind, or the contract below would not cover them."""
    sources, targets = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    for q, k in ((sources, sources), (targets, targets), (targets, sources)):
        groups = _buckets(q, k, _CALL_COST)
        assert any(len(g) > 1 and len({(q[i], k[i]) for i in g}) > 1 for g in groups), groups
        assert sorted(i for g in groups for i in g) == list(range(len(PAIRS)))


def test_long_examples_are_not_padded_to_each_other_short_ones_share_a_call():
    """Long-tailed code rows: sources capped at 512 share a call (no padding); 379 and 337 attend alone, since
    padding 337 to 379 adds 30k query x key scores, far more than a call costs (the rule before, a 25% share
    of the work, put 379 with the 512s and ran such rows 19% longer); the short ones share one call."""
    lengths = [512, 379, 20, 512, 337, 18, 19, 512]
    groups = _buckets(lengths, lengths, _CALL_COST)
    assert sorted(map(sorted, groups)) == [[0, 3, 7], [1], [2, 5, 6], [4]]
    # Cross-attention of short targets over long sources: one call when the sources are equal.
    assert _buckets([20, 18, 19], [512, 512, 512], _CALL_COST) == [[0, 2, 1]]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_packed_pairs_equal_pairs_alone(cache_dir, tmp_path, backend):
    """The doctor's packing contract (lorakit.doctor.contracts), in float32 on every backend."""
    built = _model(cache_dir, tmp_path, backend)
    result = contracts.packing(built, _rows(), packed=True, tolerance=TOL)
    assert result.passed, result.detail
    assert "encoder self, decoder self and cross attention" in result.detail


def test_seq2seq_contract_detects_leaks(cache_dir, tmp_path):
    """Negative control: dropping the cross-attention restriction makes decoder tokens see other examples."""
    built = _model(cache_dir, tmp_path, "sdpa_mask")
    rows = _rows()
    alone, _, packed = _alone_and_packed(built, rows)
    leaky = dict(packed, source_segments=torch.ones_like(packed["source_segments"]))
    leaky["target_segments"] = packed["target_segments"]
    logits = built.inputs.logits(built.model, leaky, "cpu")
    first = logits[0, : PAIRS[0][1]]
    assert (first - alone[0][0]).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("backend", ["varlen_sdpa", "sdpa_mask"])
def test_packed_seq2seq_loss_and_grads_equal_padded(cache_dir, tmp_path, backend):
    built = _model(cache_dir, tmp_path, backend)
    rows = _rows(seed=1)
    results = losses_and_grads(built, rows, _padded_and_packed(built))
    (padded_loss, padded_n, padded_g), (packed_loss, packed_n, packed_g) = results
    assert padded_n == packed_n == sum(t for _, t in PAIRS)
    assert abs(padded_loss - packed_loss) < TOL
    assert max((padded_g[n] - packed_g[n]).abs().max().item() for n in padded_g) < TOL


def _bias_sizes(model) -> list[tuple[int, ...]]:
    """Records the (query, key) sizes T5's relative_attention_bias embeddings are asked for."""
    sizes: list[tuple[int, ...]] = []
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            module.register_forward_hook(lambda _m, args, _out: sizes.append(tuple(args[0].shape)))
    return sizes


def test_position_bias_is_computed_per_example_not_per_row(cache_dir, tmp_path):
    """T5 computes its bias over the whole row (T x T, quadratic in the row); lorakit hands it the bias of
    the longest example instead. Fails if transformers stops taking `position_bias` from the hook."""
    built = _model(cache_dir, tmp_path, "varlen_sdpa")
    sizes = _bias_sizes(built.model)
    rows = _rows()
    packed = PackedSeq2SeqCollator(512, 128, built.model.config.decoder_start_token_id)(rows)
    logits = built.inputs.logits(built.model, packed, "cpu")
    token_loss_sum(logits, packed["labels"]).backward()
    longest_source, longest_target = max(s for s, _ in PAIRS), max(t for _, t in PAIRS)
    # Encoder and decoder once each, and again in gradient checkpointing's recompute.
    assert sorted(set(sizes)) == [(longest_target, longest_target), (longest_source, longest_source)]
    assert len(sizes) == 4


def test_whole_row_bias_is_exact_too(cache_dir, tmp_path):
    """Without the hook (the model called directly with the segments), T5 computes the bias over the whole
    row and the attention function takes each example's block of it: the same logits."""
    built = _model(cache_dir, tmp_path, "varlen_sdpa")
    sizes = _bias_sizes(built.model)
    rows = _rows()
    packed = PackedSeq2SeqCollator(512, 128, built.model.config.decoder_start_token_id)(rows)
    # First, before ModelInputs.logits has attached the hook to this model.
    logits = built.model(**built.inputs(packed, "cpu"), use_cache=False).logits
    row = packed["input_ids"].shape[1]
    assert (row, row) in sizes
    alone, _, _ = _alone_and_packed(built, rows)
    start = 0
    for (expected, _), (_, t) in zip(alone, PAIRS, strict=True):
        assert (logits[0, start : start + t] - expected).abs().max().item() < TOL
        start += t


def test_full_fine_tuning_position_bias_gradient_equals_padded(cache_dir, tmp_path):
    """With full fine-tuning the relative_attention_bias weights train: their gradient through the
    per-example bias equals the padded batch's, like every other weight's."""
    from lorakit.model import build_model
    from lorakit.recipe import recipe_from_dict

    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "full",
        model={"gradient_checkpointing": True},
        method={"kind": "full"},
        data={"packing": True},
    )
    built = ready_for_contract(build_model(recipe_from_dict(raw)))  # full fine-tuning: no LoRA to set
    results = losses_and_grads(built, _rows(seed=2), _padded_and_packed(built), per_token=False)
    (_, _, padded), (_, _, packed) = results
    bias = [n for n in padded if "relative_attention_bias" in n]
    assert len(bias) == 2 and all(padded[n].abs().max() > 0 for n in bias)
    assert max((padded[n] - packed[n]).abs().max().item() for n in padded) < TOL
