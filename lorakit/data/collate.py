"""Collators: dynamic padding to the longest member of each batch, never to a fixed max_length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def _pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


class Seq2SeqCollator:
    """Pads sources with the pad id (masked) and targets with -100 (ignored by the loss).

    Besides model inputs, each batch carries `num_target_tokens` (tokens the loss is taken over),
    `num_real_tokens` (non-pad source + target tokens) and `num_token_slots` (padding included), which
    the loop uses for token-weighted loss and the throughput and packing-efficiency meters.
    """

    def __init__(self, pad_token_id: int, decoder_start_token_id: int):
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        input_ids = _pad([r["input_ids"] for r in rows], self.pad_token_id)
        attention_mask = _pad([[1] * len(r["input_ids"]) for r in rows], 0)
        labels = _pad([r["labels"] for r in rows], IGNORE_INDEX)
        num_target = int((labels != IGNORE_INDEX).sum())
        # Teacher forcing: the decoder sees the start token, then the target shifted right. Built here so
        # the model never computes its own (mean) loss; the loop takes a token-weighted one.
        decoder_input_ids = torch.full_like(labels, self.pad_token_id)
        decoder_input_ids[:, 0] = self.decoder_start_token_id
        decoder_input_ids[:, 1:] = labels[:, :-1].masked_fill(
            labels[:, :-1] == IGNORE_INDEX, self.pad_token_id
        )
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": (labels != IGNORE_INDEX).long(),
            "labels": labels,
            "num_target_tokens": num_target,
            "num_real_tokens": int(attention_mask.sum()) + num_target,
            "num_token_slots": input_ids.numel() + labels.numel(),
        }


MODEL_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def model_inputs(batch: dict[str, Any], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors the model's forward takes (labels excluded: the loss is ours), moved to `device`."""
    return {k: batch[k].to(device) for k in MODEL_KEYS if k in batch}
