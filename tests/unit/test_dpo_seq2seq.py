"""FLAN-T5 DPO packed: each prompt once in the encoder row, chosen and rejected in two decoder rows.

Packed must equal padded (loss and LoRA gradients, fp32) on both packed T5 attention paths (per-example SDPA
with the position bias per example, what packed T5 recipes load; explicit masks), the encoder must run once
per pass, and no response may see another pair's prompt or the other response.
"""

from __future__ import annotations

import pytest
import torch

from lorakit.data.pair_collate import PackedSeq2SeqPairCollator, Seq2SeqPairCollator
from tests.unit.test_dpo import _assert_same, _encoder_passes, _loss_and_grads, _setup


@pytest.mark.parametrize("backend", ["varlen_sdpa", "sdpa_mask"])
def test_t5_dpo_packed_equals_padded_and_keeps_pairs_apart(cache_dir, tmp_path, backend):
    built, rows, objective = _setup(cache_dir, tmp_path, backend, "t5", seed=5)
    model = built.model
    start = model.config.decoder_start_token_id
    padded_batch = Seq2SeqPairCollator(0, start)(rows)
    packed_batch = PackedSeq2SeqPairCollator(None, None, start)(rows)
    assert packed_batch["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    packed, passes = _encoder_passes(
        model, lambda: objective.loss(model, built.inputs, packed_batch, "cpu")[0]
    )
    assert passes == 2  # the reference pass and the policy pass, each shared by both decoder rows
    padded = _loss_and_grads(model, lambda: objective.loss(model, built.inputs, padded_batch, "cpu")[0])
    # Padded equals the plain per-sequence computation (tests/unit/test_dpo.py), so packed does too.
    _assert_same(packed, padded)

    # Isolation: another prompt for pair 1 and another rejected answer for pair 2 change only theirs.
    with torch.no_grad():
        before = objective.log_probs(model, built.inputs, packed_batch, "cpu")
        changed = [dict(r) for r in rows]
        changed[1]["input_ids"] = [5, 6, 7, 1]
        changed[2]["rejected_ids"] = [9, 9, 1]
        after = objective.log_probs(
            model, built.inputs, PackedSeq2SeqPairCollator(None, None, start)(changed), "cpu"
        )
    same = [0, 1, 4]  # pair 0 both, pair 2 chosen (sequence 2k: chosen, 2k + 1: rejected)
    torch.testing.assert_close(after[same], before[same], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after[[2, 3, 5]], before[[2, 3, 5]])
