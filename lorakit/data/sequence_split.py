"""Sequence parallelism's data side: a packed causal row split along the sequence over the N ranks of a
sequence-parallel group.

Everything that needs the whole row is computed before the split, from the whole row: the position ids
(restarting at 0 per example, so rotary embeddings see each token's position in its own example) and the
example boundaries, which travel with every shard (`sequence_segments`) so that attention, which sees the
whole row again after its all-to-all (lorakit.model.sequence_parallel), keeps every example to itself.

The row is padded to a multiple of N with one extra "example" of filler tokens (label -100, positions from
0): it attends only to itself and adds no loss. Labels are already shifted per example by the collator, so
each shard's labels are the targets of its own tokens and its loss needs nothing from its neighbours.

Each shard carries its own share of the row's counts (target tokens, real tokens, slots, examples), so that
the training loop's sums over all ranks count every row once and its token-weighted loss is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from lorakit.data.collate import IGNORE_INDEX

# The sequence tensors of a packed causal row, [1, T] each.
SEQUENCE_KEYS = ("input_ids", "position_ids", "labels")
SEGMENTS = "sequence_segments"


def row_bounds(position_ids: torch.Tensor) -> tuple[int, ...]:
    """Example boundaries (0, end of example 1, ..., T) of one row of restarting position ids."""
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return (*starts, position_ids.numel())


def _shares(total: int, world: int) -> list[int]:
    """`total` split into `world` whole shares as even as possible (the first ones take the remainder)."""
    base, extra = divmod(total, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def split_row(batch: dict[str, Any], rank: int, world: int, pad_id: int = 0) -> dict[str, Any]:
    """The `rank`-th of `world` sequence shards of a packed causal batch (one row)."""
    if batch["input_ids"].shape[0] != 1:
        raise ValueError(
            f"sequence parallelism splits one packed row per micro-batch, got {batch['input_ids'].shape[0]}"
        )
    length = batch["input_ids"].shape[1]
    padded = world * math.ceil(length / world)
    fill = padded - length
    row = {k: batch[k][0] for k in SEQUENCE_KEYS}
    if fill:
        row["input_ids"] = torch.cat([row["input_ids"], torch.full((fill,), pad_id, dtype=torch.long)])
        row["position_ids"] = torch.cat([row["position_ids"], torch.arange(fill, dtype=torch.long)])
        row["labels"] = torch.cat([row["labels"], torch.full((fill,), IGNORE_INDEX, dtype=torch.long)])
    bounds = row_bounds(row["position_ids"])
    local = padded // world
    start, end = rank * local, (rank + 1) * local
    out = dict(batch)
    for k in SEQUENCE_KEYS:
        out[k] = row[k][start:end].unsqueeze(0).contiguous()
    out[SEGMENTS] = bounds
    out["num_target_tokens"] = int((out["labels"] != IGNORE_INDEX).sum())
    out["num_real_tokens"] = max(0, min(end, length) - start)
    out["num_token_slots"] = _shares(int(batch["num_token_slots"]), world)[rank]
    # An example counts on the rank that holds its first token (filler excluded).
    out["num_examples"] = sum(1 for b in bounds[:-1] if start <= b < end and b < length)
    return out


class SequenceSplit:
    """Collator: a packed causal collator's row, then this rank's shard of it (split_row)."""

    def __init__(self, collator, rank: int, world: int, pad_id: int = 0):
        self.collator, self.rank, self.world, self.pad_id = collator, rank, world, pad_id
        # Batching.describe and the planner read the wrapped collator's capacity.
        self.max_tokens = getattr(collator, "max_tokens", None)

    def __call__(self, rows) -> dict[str, Any]:
        return split_row(self.collator(rows), self.rank, self.world, self.pad_id)


def split_sequences(batching, sp_rank: int, sp_world: int, pad_id: int | None = 0):
    """`batching` (lorakit.data.batching.Batching) with its training collator splitting rows over a
    sequence-parallel group of `sp_world` ranks; unchanged when `sp_world` is 1. Eval batches stay whole."""
    if sp_world == 1:
        return batching
    if not batching.packing:
        raise ValueError("sequence parallelism splits packed causal rows; this batching does not pack")
    collator = SequenceSplit(batching.collator, sp_rank, sp_world, pad_id or 0)
    return dataclasses.replace(batching, collator=collator)


# Eval shards: which example of the batch (0, 1, ...) each token belongs to; -1 for the filler.
EXAMPLE_INDEX = "example_index"


def split_eval_rows(rows, rank: int, world: int, pad_id: int = 0) -> dict[str, Any]:
    """The `rank`-th of `world` shards of eval rows (tokenized causal examples) packed into one row, as
    training splits its rows; `example_index` says which row each of the shard's tokens belongs to, for
    per-row losses."""
    from lorakit.data.collate import PackedCausalCollator

    whole = PackedCausalCollator(sum(len(r["input_ids"]) for r in rows))(rows)
    shard = split_row(whole, rank, world, pad_id)
    index = torch.cat([torch.full((len(r["input_ids"]),), i, dtype=torch.long) for i, r in enumerate(rows)])
    fill = world * shard["input_ids"].shape[1] - index.numel()
    index = torch.cat([index, torch.full((fill,), -1, dtype=torch.long)])
    local = shard["input_ids"].shape[1]
    shard[EXAMPLE_INDEX] = index[rank * local : (rank + 1) * local].unsqueeze(0)
    return shard
