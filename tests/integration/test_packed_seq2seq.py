"""The packing contract for encoder-decoders: a packed (encoder row, decoder row) pair computes exactly what
each of its (source, target) examples computes alone, in the training configuration (train mode, gradient
checkpointing on, LoRA attached with a non-zero update), through ModelInputs.logits as the loop calls it."""

from __future__ import annotations

import pytest
import torch

from lorakit.data.collate import PackedSeq2SeqCollator, Seq2SeqCollator
from lorakit.engine.loss import token_loss_sum
from tests.conftest import PACKING_BACKENDS, training_config_model

# (source, target) lengths; sources longer than T5's relative-attention max distance (128) on purpose.
PAIRS = ((37, 9), (150, 20), (5, 3), (71, 14))
TOL = 1e-4


BACKENDS = PACKING_BACKENDS


def _model(cache_dir, tmp_path, backend: str):
    return training_config_model(cache_dir, tmp_path / "run", backend)


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


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_packed_pairs_equal_pairs_alone(cache_dir, tmp_path, backend):
    built = _model(cache_dir, tmp_path, backend)
    alone, sliced, _ = _alone_and_packed(built, _rows())
    for (la, sa), (lp, sp) in zip(alone, sliced, strict=True):
        assert (la - lp).abs().max().item() < TOL
        assert abs(sa.item() - sp.item()) < TOL * max(1.0, abs(sa.item()))


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
    start_id = built.model.config.decoder_start_token_id
    results = []
    for collate in (Seq2SeqCollator(0, start_id), PackedSeq2SeqCollator(512, 128, start_id)):
        built.model.zero_grad()
        batch = collate(rows)
        logits = built.inputs.logits(built.model, batch, "cpu")
        loss = token_loss_sum(logits, batch["labels"]) / batch["num_target_tokens"]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in built.model.named_parameters() if p.requires_grad}
        results.append((loss.item(), batch["num_target_tokens"], grads))
    (padded_loss, padded_n, padded_g), (packed_loss, packed_n, packed_g) = results
    assert padded_n == packed_n == sum(t for _, t in PAIRS)
    assert abs(padded_loss - packed_loss) < TOL
    assert max((padded_g[n] - packed_g[n]).abs().max().item() for n in padded_g) < TOL
