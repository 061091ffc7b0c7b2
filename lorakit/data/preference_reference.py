"""Reference log-probabilities that ride with preference pairs (full fine-tuning DPO).

Full fine-tuning has no adapter to turn off, so the reference model's summed response log-probabilities
are computed once, before the first step (lorakit.objectives.dpo_reference), and added to the prepared splits
as two columns. The collators below carry them into every batch as `reference_log_probs`: (2 x pairs,),
chosen and rejected of each pair in turn, the order of the objective's own log-probabilities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import datasets
import torch

REFERENCE_COLUMNS = ("ref_chosen", "ref_rejected")
BATCH_KEY = "reference_log_probs"


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


def with_reference(batching):
    """`batching` (lorakit.data.batching.Batching) with both collators carrying reference log-probs."""
    return dataclasses.replace(
        batching,
        collator=WithReference(batching.collator),
        eval_collator=WithReference(batching.eval_collator),
    )


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
