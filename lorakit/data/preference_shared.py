"""Packed DPO rows with the prompt counted once: each pair one segment [prompt][chosen][rejected].

The default for causal LMs that pack (dpo.share_prompt): instead of prompt + chosen and prompt + rejected as
two sequences, a pair takes prompt + chosen + rejected tokens of its row, and the multipack sampler budgets
it at that length, so the prompt is neither computed nor counted twice. The row's attention is a tree
(lorakit.model.shared_prompt): the rejected tokens see the prompt and themselves, never the chosen ones, and
their position ids continue from the prompt's end, as they would alone after the prompt.

A batch carries `pair_spans` ((prompt, chosen, rejected) lengths per pair, in row order) and the scoring of
its responses as three flat lists: `target_index` (the row position whose logits score a response token:
the token before it in its own sequence, which for the first chosen and the first rejected token is the
prompt's last one), `target_ids` (the token) and `target_sequence` (2k: pair k's chosen response, 2k + 1:
its rejected one), so lorakit.objectives.dpo sums each response's log-probabilities as for unshared rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lorakit.data.micro_batches import Batching
from lorakit.data.multipack import MultipackBatchSampler
from lorakit.errors import DataError
from lorakit.recipe.known_objectives import section_of

_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
# Batch key of the pairs' (prompt, chosen, rejected) lengths, in row order.
PAIR_SPANS = "pair_spans"


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


def _say(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def shared_prompt_batching(
    recipe, data, max_tokens: int, padded, *, world: int, rank: int, problem: str | None = None
) -> Batching | None:
    """Multipack rows of shared-prompt pairs, or None where the prompt is not shared (dpo.share_prompt
    false, or `problem`: why the model's attention cannot run the tree, said on the console; the model
    layer knows, lorakit.model.shared_prompt.sharing_problem)."""
    if not section_of(recipe).share_prompt:  # dpo.share_prompt (orpo., kto.)
        return None
    if problem is not None:
        _say(f"dpo.share_prompt: each pair's prompt is packed twice here: {problem}")
        return None
    lengths = shared_lengths(data.train)
    if max(lengths) > max_tokens:
        raise DataError(
            f"train.max_tokens={max_tokens} is smaller than the longest preference pair ({max(lengths)} "
            "tokens: prompt + chosen + rejected, packed together); raise train.max_tokens or lower "
            "data.max_length"
        )
    sampler = MultipackBatchSampler(
        lengths, max_tokens, num_replicas=world, rank=rank, seed=recipe.train.seed
    )
    return Batching(sampler, SharedPromptCollator(max_tokens), padded, True, max_tokens, sampler.efficiency())
