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

from lorakit.data.collate import PackedSeq2SeqCollator
from lorakit.data.preference_batching import SIDES


def pair_lengths(data) -> tuple[list[int], list[int]]:
    """(source tokens, longer response's tokens) of every training pair."""
    src = [len(x) for x in data.train["input_ids"]]
    tgt = [
        max(len(c), len(r)) for c, r in zip(data.train["chosen_ids"], data.train["rejected_ids"], strict=True)
    ]
    return src, tgt


class PackedSeq2SeqPairCollator:
    """Pairs as one encoder row and a chosen and a rejected decoder row (segments 1..pairs): each side is
    lorakit.data.collate.PackedSeq2SeqCollator's row of (prompt, that side's response), with its capacities
    (None: the rows' own lengths), so each decoder row stays within `max_target_tokens`."""

    def __init__(
        self, max_source_tokens: int | None, max_target_tokens: int | None, decoder_start_token_id: int
    ):
        self.max_source_tokens = max_source_tokens
        self.side = PackedSeq2SeqCollator(max_source_tokens, max_target_tokens, decoder_start_token_id)

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        targets = slots = 0
        for side in SIDES:
            row = self.side([{"input_ids": r["input_ids"], "labels": r[f"{side}_ids"]} for r in rows])
            out[f"{side}_labels"] = row["labels"]
            out[f"{side}_decoder_input_ids"] = row["decoder_input_ids"]
            out[f"{side}_target_segments"] = row["target_segments"]
            targets += row["num_target_tokens"]
            # Each side's slots count the one encoder row too; it is counted once below.
            slots += row["num_token_slots"]
        src = row["input_ids"].size(1)
        cap_src = src if self.max_source_tokens is None else self.max_source_tokens
        out.update(
            input_ids=row["input_ids"],
            source_segments=row["source_segments"],
            num_target_tokens=targets,
            num_real_tokens=src + targets,
            num_token_slots=slots - (len(SIDES) - 1) * cap_src,
            num_examples=len(rows),
            num_pairs=len(rows),
        )
        return out
