"""Collators of the `pairs` and `unpaired` row layouts: a pair (or a KTO row with its mismatched completion)
never leaves its micro-batch; lorakit.data.batching chooses among them.

Every pair becomes two sequences, chosen then rejected; sequence 2k is pair k's chosen one, 2k + 1 its
rejected one, and `sequence_ids` (shaped like `labels`) says which sequence each target token belongs to,
so the objective sums log-probabilities per sequence whatever the layout:

- causal LMs, padded: 2 x pairs rows, right-padded (CausalPairCollator);
- causal LMs, packed: both sequences of each pair in one row, position_ids restarting per sequence
  (PackedCausalPairCollator), or with the prompt once, each pair one segment [prompt][chosen][rejected]
  (SharedPromptCollator, the default: dpo.share_prompt). The row's attention is then a tree
  (lorakit.model.shared_prompt): the rejected tokens see the prompt and themselves, never the chosen ones,
  their position ids continuing from the prompt's end. Its batch carries `pair_spans` ((prompt, chosen,
  rejected) lengths per pair) and the scoring of its responses as three flat lists: `target_index` (the row
  position whose logits score a response token), `target_ids` and `target_sequence` (2k: pair k's chosen
  response, 2k + 1: its rejected one);
- encoder-decoders: the source once per pair (encoder row i = pair i), the chosen and rejected targets as
  two decoder batches (`chosen_*` / `rejected_*` keys); packed (PackedSeq2SeqPairCollator), ONE encoder row
  holding each prompt once (segment k = pair k) and a chosen and a rejected decoder row, each response in
  its pair's segment, with the packed seq2seq attention of lorakit.model.inputs.

Batches carry `num_pairs` (the loss's divisor) besides the token counts every batch carries; with full
fine-tuning the rows' reference log-probabilities (WithReference: `reference_log_probs`, (2 x pairs,),
computed before training by lorakit.objectives.dpo_reference), and KTO's rows their labels (WithLabels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets
import torch

from lorakit.data.collate import (
    IGNORE_INDEX,
    PackedSeq2SeqCollator,
    decoder_inputs,
    pack_sequences,
    pad,
    right_pad_sources,
    shift_labels,
)
from lorakit.data.layouts import Collators

SIDES = ("chosen", "rejected")
_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
# Batch key of the pairs' (prompt, chosen, rejected) lengths, in row order (shared-prompt rows).
PAIR_SPANS = "pair_spans"
REFERENCE_COLUMNS = ("ref_chosen", "ref_rejected")
BATCH_KEY = "reference_log_probs"
# Batch key of KTO rows' labels (True: desirable), in the order of the pairs.
LABELS = "kto_desirable"


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


def shared_lengths(dataset) -> list[int]:
    """prompt + chosen + rejected tokens of every pair of a causal preference dataset (read column-wise)."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    total = None
    for key in _IDS:
        n = pc.list_value_length(table[key])
        total = n if total is None else pc.add(total, n)
    return total.to_pylist()


class SharedPromptCollator:
    """Pairs packed into ONE row of at most `max_tokens`, each as [prompt][chosen][rejected] (module
    docstring)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int, int]] = []
        index: list[int] = []
        targets: list[int] = []
        sequence: list[int] = []
        for k, r in enumerate(rows):
            prompt, chosen, rejected = (list(r[key]) for key in _IDS)
            s, p, c = len(ids), len(prompt), len(chosen)
            ids += prompt + chosen + rejected
            positions += [*range(p + c), *range(p, p + len(rejected))]
            spans.append((p, c, len(rejected)))
            for seq, start, response in ((2 * k, s + p, chosen), (2 * k + 1, s + p + c, rejected)):
                for j, token in enumerate(response):
                    before = start + j - 1 if j else s + p - 1
                    if before < s:  # no prompt: a sequence's first token is scored by nothing
                        continue
                    index.append(before)
                    targets.append(token)
                    sequence.append(seq)
        if len(ids) > self.max_tokens:
            raise ValueError(f"packed row of {len(ids)} tokens exceeds max_tokens={self.max_tokens}")
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
            PAIR_SPANS: torch.tensor(spans, dtype=torch.long).reshape(-1, 3),
            "target_index": torch.tensor(index, dtype=torch.long),
            "target_ids": torch.tensor(targets, dtype=torch.long),
            "target_sequence": torch.tensor(sequence, dtype=torch.long),
            "num_target_tokens": len(targets),
            "num_real_tokens": len(ids),
            "num_token_slots": self.max_tokens,
            "num_examples": len(rows),
            "num_pairs": len(rows),
        }


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


class WithReference:
    """A pair collator whose batches also carry the rows' reference log-probabilities, when they have
    them (rows without the columns pass through unchanged: LoRA DPO takes its reference live)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(rows)
        if rows and REFERENCE_COLUMNS[0] in rows[0]:
            values = [[r[c] for c in REFERENCE_COLUMNS] for r in rows]
            batch[BATCH_KEY] = torch.tensor(values, dtype=torch.float32).reshape(-1)
        return batch


def add_reference(ds: datasets.Dataset, table: torch.Tensor, key: str) -> datasets.Dataset:
    """`ds` with the (rows, 2) float32 `table` as its reference columns (row i: pair i's chosen, rejected);
    `key` names the table (lorakit.objectives.dpo_reference.reference_key)."""
    if table.shape != (len(ds), 2):
        raise ValueError(f"reference table of shape {tuple(table.shape)} for {len(ds)} pairs")
    out = ds.remove_columns([c for c in REFERENCE_COLUMNS if c in ds.column_names])
    for j, name in enumerate(REFERENCE_COLUMNS):
        # A fingerprint of our own: datasets would otherwise hash the whole column to make one. float64
        # holds each float32 value exactly.
        out = out.add_column(name, table[:, j].tolist(), new_fingerprint=f"{key}-{len(ds)}-{name}")
    return out


class WithLabels:
    """A collator of KTO rows in the pair layout whose batches also carry the rows' labels (LABELS)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(rows)
        batch[LABELS] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
        return batch


def pair_collators(tokenizer, config, labels: bool = False) -> Collators:
    """The collators of pairs (and, `labels`, of KTO's rows) on a model of `config`: every one carries the
    rows' reference log-probabilities when they have them."""

    def wrap(collator):
        collator = WithReference(collator)
        return WithLabels(collator) if labels else collator

    return Collators(
        padded=pair_collator(tokenizer, config),
        packed_causal=PackedCausalPairCollator,
        packed_seq2seq=PackedSeq2SeqPairCollator,
        seq2seq_lengths=pair_lengths,
        sequences=2,
        unit="preference pair",
        packed_as="prompt + chosen and prompt + rejected, packed together",
        shared_prompt=(shared_lengths, SharedPromptCollator),
        wrap=wrap,
    )
