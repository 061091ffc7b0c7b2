"""Micro-batches of preference pairs (train.objective dpo): a pair never leaves its micro-batch.

Every pair becomes two sequences, chosen then rejected; sequence 2k is pair k's chosen one, 2k + 1 its
rejected one, and `sequence_ids` (shaped like `labels`) says which sequence each target token belongs to,
so the objective sums log-probabilities per sequence whatever the layout:

- causal LMs, packed: the sampler (multipack) places whole pairs, the collator writes both sequences of
  each pair into one row with position_ids restarting per sequence, so attention stays inside each sequence
  exactly as for packed SFT examples (lorakit.model.inputs);
- causal LMs, padded: 2 x pairs rows, right-padded;
- encoder-decoders: the source once per pair (encoder row i = pair i), the chosen and rejected targets as
  two decoder batches (`chosen_*` / `rejected_*` keys), so the encoder runs once per pair.

Batches carry `num_pairs` (the DPO loss's divisor) besides the token counts every batch carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lorakit.data.collate import (
    IGNORE_INDEX,
    decoder_inputs,
    pack_sequences,
    pad,
    right_pad_sources,
    shift_labels,
)
from lorakit.data.micro_batches import Batching
from lorakit.data.multipack import MultipackBatchSampler
from lorakit.data.sampler import LengthGroupedBatchSampler
from lorakit.errors import DataError
from lorakit.recipe import Recipe

SIDES = ("chosen", "rejected")


def _sequences(rows: Sequence[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, shifted labels) of every sequence, chosen and rejected of each pair in turn."""
    out = []
    for r in rows:
        prompt = list(r["prompt_ids"])
        for side in SIDES:
            response = list(r[f"{side}_ids"])
            out.append((prompt + response, shift_labels([IGNORE_INDEX] * len(prompt) + response)))
    return out


def _counts(labels: torch.Tensor, rows: int, real: int, slots: int) -> dict[str, Any]:
    return {
        "num_target_tokens": int((labels != IGNORE_INDEX).sum()),
        "num_real_tokens": real,
        "num_token_slots": slots,
        "num_examples": rows,
        "num_pairs": rows,
    }


class CausalPairCollator:
    """Pairs as 2 x pairs right-padded rows (chosen, rejected, chosen, ...); row i is sequence i."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        seqs = _sequences(rows)
        input_ids = pad([s for s, _ in seqs], self.pad_token_id)
        labels = pad([lab for _, lab in seqs], IGNORE_INDEX)
        attention_mask = pad([[1] * len(s) for s, _ in seqs], 0)
        sequence_ids = torch.arange(len(seqs))[:, None].expand_as(labels).contiguous()
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "sequence_ids": sequence_ids,
            **_counts(labels, len(rows), int(attention_mask.sum()), input_ids.numel()),
        }


class PackedCausalPairCollator:
    """Pairs packed into ONE row of at most `max_tokens`: every sequence with its own position_ids from 0,
    so attention never crosses sequences (block-diagonal causal, as for packed SFT rows)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        row, sequence = pack_sequences(_sequences(rows), self.max_tokens)
        return {
            **row,
            "sequence_ids": torch.tensor([sequence], dtype=torch.long),
            **_counts(row["labels"], len(rows), len(sequence), self.max_tokens),
        }


class Seq2SeqPairCollator:
    """Sources padded once per pair; chosen and rejected targets as two padded decoder batches."""

    def __init__(self, pad_token_id: int, decoder_start_token_id: int):
        self.pad_token_id, self.decoder_start_token_id = pad_token_id, decoder_start_token_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = dict(right_pad_sources([r["input_ids"] for r in rows], self.pad_token_id))
        real, slots = int(out["attention_mask"].sum()), out["input_ids"].numel()
        targets = 0
        for side in SIDES:
            labels = pad([r[f"{side}_ids"] for r in rows], IGNORE_INDEX)
            out[f"{side}_labels"] = labels
            out[f"{side}_decoder_input_ids"] = decoder_inputs(
                labels, self.pad_token_id, self.decoder_start_token_id
            )
            out[f"{side}_decoder_attention_mask"] = (labels != IGNORE_INDEX).long()
            targets += int((labels != IGNORE_INDEX).sum())
            slots += labels.numel()
        out.update(
            num_target_tokens=targets,
            num_real_tokens=real + targets,
            num_token_slots=slots,
            num_examples=len(rows),
            num_pairs=len(rows),
        )
        return out


def pair_collator(tokenizer, config):
    """The padded pair collator of the model family (evaluation, and training without packing)."""
    if getattr(config, "is_encoder_decoder", False):
        from lorakit.model.families.start import decoder_start_token_id

        return Seq2SeqPairCollator(tokenizer.pad_token_id, decoder_start_token_id(config))
    return CausalPairCollator(tokenizer.pad_token_id)


def preference_batching(
    recipe: Recipe,
    data,
    tokenizer,
    config,
    *,
    share_prompt_problem: str | None = None,
    packing: bool,
    world: int = 1,
    rank: int = 0,
) -> Batching:
    """Sampler and collators of preference pairs: multipack rows of whole pairs for causal LMs that pack
    (each pair's prompt once, unless dpo.share_prompt is off or `share_prompt_problem` says why the model
    cannot), else micro-batches of train.micro_batch_size pairs grouped by length and padded."""
    t = recipe.train
    padded = pair_collator(tokenizer, config)
    lengths = data.train["length"]
    if packing and not getattr(config, "is_encoder_decoder", False):
        # Both sequences of a pair go into one row: a padded micro-batch's worth is twice max_length a pair.
        max_tokens = t.max_tokens or t.micro_batch_size * 2 * data.lengths.max_length
        from lorakit.data.preference_shared import shared_prompt_batching

        shared = shared_prompt_batching(
            recipe, data, max_tokens, padded, world=world, rank=rank, problem=share_prompt_problem
        )
        if shared is not None:
            return shared
        if max(lengths) > max_tokens:
            raise DataError(
                f"train.max_tokens={max_tokens} is smaller than the longest preference pair ({max(lengths)} "
                "tokens: prompt + chosen and prompt + rejected, packed together); raise train.max_tokens or "
                "lower data.max_length"
            )
        sampler = MultipackBatchSampler(lengths, max_tokens, num_replicas=world, rank=rank, seed=t.seed)
        collator = PackedCausalPairCollator(max_tokens)
        return Batching(sampler, collator, padded, True, max_tokens, sampler.efficiency())
    sampler = LengthGroupedBatchSampler(
        lengths,
        t.micro_batch_size,
        num_replicas=world,
        rank=rank,
        seed=t.seed,
        group_by_length=recipe.data.group_by_length,
    )
    return Batching(sampler, padded, padded, False)
