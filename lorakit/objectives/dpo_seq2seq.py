"""Summed response log-probabilities of packed encoder-decoder pairs (lorakit.data.pair_collate).

The encoder row (each pair's prompt once) runs once; the chosen and the rejected decoder rows then run on
its output, each with the attention lorakit.model.inputs builds for a packed seq2seq row pair: per-example
SDPA with T5's position bias per example (lorakit_varlen_sdpa, what packed T5 recipes load, on CPU too) or
explicit masks (sdpa, eager). The masks and boundaries of the encoder are the same for both decoder rows,
so building them from either row's batch gives the encoder the same attention.
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.data.pair_collate import SIDES
from lorakit.model.inputs import CROSS_MASK
from lorakit.model.loss import sequence_log_probs
from lorakit.model.varlen import attach_t5_position_bias

SEGMENTS = "lorakit_seq2seq_segments"


def packed_seq2seq_log_probs(engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
    """(2 x pairs,) summed response log-probabilities, chosen and rejected of each pair in turn."""
    module = getattr(engine, "module", engine)  # a DeepSpeed engine wraps the (peft) model
    pairs = batch["num_pairs"]
    encoder_outputs = None
    per_side = []
    for side in SIDES:
        row = {
            "input_ids": batch["input_ids"],
            "source_segments": batch["source_segments"],
            "decoder_input_ids": batch[f"{side}_decoder_input_ids"],
            "target_segments": batch[f"{side}_target_segments"],
        }
        kwargs = inputs(row, device)
        if SEGMENTS in kwargs:
            attach_t5_position_bias(module)  # T5's bias per example, not over the whole row (idempotent)
        input_ids = kwargs.pop("input_ids")
        cross = kwargs.pop(CROSS_MASK, None)
        encoder_mask = kwargs.pop("attention_mask", None)
        if encoder_outputs is None:
            extra = {SEGMENTS: kwargs[SEGMENTS]} if SEGMENTS in kwargs else {}
            encoder_outputs = module.get_encoder()(input_ids=input_ids, attention_mask=encoder_mask, **extra)
        if cross is not None:
            kwargs["attention_mask"] = cross  # the decoder's encoder_attention_mask: its own pair only
        logits = engine(encoder_outputs=encoder_outputs, use_cache=False, **kwargs).logits
        segments = batch[f"{side}_target_segments"] - 1
        per_side.append(sequence_log_probs(logits, batch[f"{side}_labels"], segments, pairs))
    return torch.stack(per_side, dim=1).reshape(-1)
