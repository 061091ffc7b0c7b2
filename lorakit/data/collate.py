"""Collators: dynamic padding to the longest member of a batch (never to a fixed max_length), or packing.

Every batch carries, besides model inputs, `num_target_tokens` (tokens the loss is taken over),
`num_real_tokens` (useful tokens), `num_token_slots` (the batch's capacity) and `num_examples`, which
the loop uses for token-weighted loss and the throughput, sample and packing-efficiency meters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """(rows, longest) long tensor of `rows` right-padded with `value`."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


class Seq2SeqCollator:
    """Pads sources with the pad id (masked) and targets with -100 (ignored by the loss)."""

    def __init__(self, pad_token_id: int, decoder_start_token_id: int):
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        sources = right_pad_sources([r["input_ids"] for r in rows], self.pad_token_id)
        input_ids, attention_mask = sources["input_ids"], sources["attention_mask"]
        labels = pad([r["labels"] for r in rows], IGNORE_INDEX)
        num_target = int((labels != IGNORE_INDEX).sum())
        decoder_input_ids = decoder_inputs(labels, self.pad_token_id, self.decoder_start_token_id)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": (labels != IGNORE_INDEX).long(),
            "labels": labels,
            "num_target_tokens": num_target,
            "num_real_tokens": int(attention_mask.sum()) + num_target,
            "num_token_slots": input_ids.numel() + labels.numel(),
            "num_examples": len(rows),
        }


def decoder_inputs(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: the decoder sees the start token, then the padded `labels` shifted right. Built by
    the collator so the model never computes its own (mean) loss; the loop takes a token-weighted one."""
    decoder = torch.full_like(labels, pad_token_id)
    decoder[:, 0] = decoder_start_token_id
    decoder[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORE_INDEX, pad_token_id)
    return decoder


def shift_labels(labels: Sequence[int]) -> list[int]:
    """Causal LM targets: position t predicts token t+1; the last position of an example predicts nothing.

    Rows store labels aligned with input_ids (-100 where no loss is taken); shifting here, per example,
    puts -100 at every example's last position, so no token is ever trained to predict the next example.
    """
    return list(labels[1:]) + [IGNORE_INDEX]


class CausalCollator:
    """Right-pads causal rows (pad id, masked) with labels shifted per example."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        input_ids = pad([r["input_ids"] for r in rows], self.pad_token_id)
        attention_mask = pad([[1] * len(r["input_ids"]) for r in rows], 0)
        labels = pad([shift_labels(r["labels"]) for r in rows], IGNORE_INDEX)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "num_target_tokens": int((labels != IGNORE_INDEX).sum()),
            "num_real_tokens": int(attention_mask.sum()),
            "num_token_slots": input_ids.numel(),
            "num_examples": len(rows),
        }


class PackedCausalCollator:
    """Concatenates a micro-batch of causal rows into ONE row with position_ids restarting per example.

    The model never sees an attention mask from here: `lorakit.model.packing` turns the position_ids into
    per-example (block-diagonal causal) attention for each backend. The row is not padded; its capacity,
    `max_tokens`, is what `num_token_slots` reports, so the packing efficiency says how full rows are.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        row, _ = pack_sequences([(r["input_ids"], shift_labels(r["labels"])) for r in rows], self.max_tokens)
        return {
            **row,
            "num_target_tokens": int((row["labels"] != IGNORE_INDEX).sum()),
            "num_real_tokens": row["input_ids"].shape[1],
            "num_token_slots": self.max_tokens,
            "num_examples": len(rows),
        }


def pack_sequences(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """(input_ids, shifted labels) sequences concatenated into ONE row of at most `max_tokens`, each with
    position_ids from 0: the row's input_ids, position_ids and labels, and which sequence each token is."""
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    sequence: list[int] = []
    for k, (seq, lab) in enumerate(sequences):
        ids += seq
        positions += range(len(seq))
        labels += lab
        sequence += [k] * len(seq)
    if len(ids) > max_tokens:
        raise ValueError(f"packed row of {len(ids)} tokens exceeds max_tokens={max_tokens}")
    row = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
    }
    return row, sequence


class PackedSeq2SeqCollator:
    """Packs a micro-batch of (source, target) rows into ONE encoder row and ONE decoder row.

    Sources are concatenated into the encoder row, targets into the decoder row; `source_segments` and
    `target_segments` say which example (1, 2, ...) each token belongs to, from which lorakit.model.inputs
    builds the three masks (encoder: same example; decoder: same example and causal; cross: same example).
    Decoder inputs restart with the decoder start token at every example. Rows are not padded: their
    capacities are what `num_token_slots` reports, or with no capacities (rows of a fixed number of
    examples, lorakit.data.balanced.BalancedRandomBatchSampler) the rows' own lengths.
    """

    def __init__(
        self, max_source_tokens: int | None, max_target_tokens: int | None, decoder_start_token_id: int
    ):
        self.max_source_tokens, self.max_target_tokens = max_source_tokens, max_target_tokens
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        src: list[int] = []
        src_seg: list[int] = []
        tgt: list[int] = []
        dec: list[int] = []
        tgt_seg: list[int] = []
        for k, r in enumerate(rows, start=1):
            src.extend(r["input_ids"])
            src_seg.extend([k] * len(r["input_ids"]))
            labels = list(r["labels"])
            tgt.extend(labels)
            dec.extend([self.decoder_start_token_id, *labels[:-1]])
            tgt_seg.extend([k] * len(labels))
        cap_src = len(src) if self.max_source_tokens is None else self.max_source_tokens
        cap_tgt = len(tgt) if self.max_target_tokens is None else self.max_target_tokens
        if len(src) > cap_src or len(tgt) > cap_tgt:
            raise ValueError(
                f"packed rows of {len(src)} source / {len(tgt)} target tokens exceed the capacities "
                f"{self.max_source_tokens} / {self.max_target_tokens}"
            )
        return {
            "input_ids": torch.tensor([src], dtype=torch.long),
            "source_segments": torch.tensor([src_seg], dtype=torch.long),
            "decoder_input_ids": torch.tensor([dec], dtype=torch.long),
            "target_segments": torch.tensor([tgt_seg], dtype=torch.long),
            "labels": torch.tensor([tgt], dtype=torch.long),
            "num_target_tokens": len(tgt),
            "num_real_tokens": len(src) + len(tgt),
            "num_token_slots": cap_src + cap_tgt,
            "num_examples": len(rows),
        }


def left_pad_prompts(prompts: Sequence[Sequence[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Causal-LM generation inputs: prompts left-padded, so every row's continuation starts at one column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def right_pad_sources(sources: Sequence[Sequence[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Encoder inputs padded on the right to the longest, with their attention mask (what Seq2SeqCollator
    gives the encoder, and what encoder-decoders generate from)."""
    return {
        "input_ids": pad(sources, pad_token_id),
        "attention_mask": pad([[1] * len(s) for s in sources], 0),
    }


def padded_collator(tokenizer, config):
    """The collator of eval batches (and of unpacked training): padded, never packed, so the loss of a row
    does not depend on which rows share its batch."""
    if getattr(config, "is_encoder_decoder", False):
        from lorakit.model.families.start import decoder_start_token_id

        return Seq2SeqCollator(tokenizer.pad_token_id, decoder_start_token_id(config))
    return CausalCollator(tokenizer.pad_token_id)
