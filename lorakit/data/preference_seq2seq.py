"""Packed preference pairs for encoder-decoders (FLAN-T5, train.objective dpo with data.packing).

A micro-batch of pairs becomes ONE encoder row holding each pair's prompt once (segment k = pair k) and TWO
decoder rows, one with every pair's chosen response, one with every rejected response, each response in
its pair's segment k. The encoder runs once per micro-batch; each decoder row runs with the packed seq2seq
attention of lorakit.model.inputs (decoder self-attention within a response and causal, cross-attention
from a response to its own pair's prompt only), so chosen and rejected never see each other and a response
sees only its prompt. The layout is the SFT packed seq2seq layout (lorakit.data.collate.
PackedSeq2SeqCollator) with the decoder row doubled; the samplers are SFT's too (lorakit.data.batching),
fed with each pair's source length and its longer response (both decoder rows must fit their capacity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lorakit.data.preference_batching import SIDES


def pair_lengths(data) -> tuple[list[int], list[int]]:
    """(source tokens, longer response's tokens) of every training pair."""
    src = [len(x) for x in data.train["input_ids"]]
    tgt = [
        max(len(c), len(r)) for c, r in zip(data.train["chosen_ids"], data.train["rejected_ids"], strict=True)
    ]
    return src, tgt


class PackedSeq2SeqPairCollator:
    """Pairs as one encoder row and a chosen and a rejected decoder row (segments 1..pairs); capacities as
    lorakit.data.collate.PackedSeq2SeqCollator's (None: the rows' own lengths), each decoder row within
    `max_target_tokens`."""

    def __init__(
        self, max_source_tokens: int | None, max_target_tokens: int | None, decoder_start_token_id: int
    ):
        self.max_source_tokens, self.max_target_tokens = max_source_tokens, max_target_tokens
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        src: list[int] = []
        src_seg: list[int] = []
        for k, r in enumerate(rows, start=1):
            src += r["input_ids"]
            src_seg += [k] * len(r["input_ids"])
        out: dict[str, Any] = {
            "input_ids": torch.tensor([src], dtype=torch.long),
            "source_segments": torch.tensor([src_seg], dtype=torch.long),
        }
        cap_src = len(src) if self.max_source_tokens is None else self.max_source_tokens
        targets = slots = 0
        for side in SIDES:
            labels: list[int] = []
            decoder: list[int] = []
            segments: list[int] = []
            for k, r in enumerate(rows, start=1):
                response = list(r[f"{side}_ids"])
                labels += response
                decoder += [self.decoder_start_token_id, *response[:-1]]
                segments += [k] * len(response)
            cap = len(labels) if self.max_target_tokens is None else self.max_target_tokens
            if len(src) > cap_src or len(labels) > cap:
                raise ValueError(
                    f"packed pair rows of {len(src)} source / {len(labels)} {side} tokens exceed the capacities "
                    f"{self.max_source_tokens} / {self.max_target_tokens}"
                )
            out[f"{side}_labels"] = torch.tensor([labels], dtype=torch.long)
            out[f"{side}_decoder_input_ids"] = torch.tensor([decoder], dtype=torch.long)
            out[f"{side}_target_segments"] = torch.tensor([segments], dtype=torch.long)
            targets += len(labels)
            slots += cap
        out.update(
            num_target_tokens=targets,
            num_real_tokens=len(src) + targets,
            num_token_slots=cap_src + slots,
            num_examples=len(rows),
            num_pairs=len(rows),
        )
        return out
