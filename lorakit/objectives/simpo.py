"""SimPO (dpo.loss: simpo): preference tuning without a reference model.

SimPO (Meng, Xia & Chen 2024, "Simple Preference Optimization with a Reference-Free Reward") rewards a
response by its policy log-probability averaged over its tokens, beta x log p(y | x) / |y|, and asks the
chosen reward to exceed the rejected one by a target margin gamma (dpo.simpo_gamma):

    loss = -(1 - ls) log sigmoid(beta (avg_chosen - avg_rejected) - gamma)
           - ls log sigmoid(-(beta (avg_chosen - avg_rejected) - gamma))          (ls: dpo.label_smoothing)

No reference pass is run, so the adapter is never turned off; the per-step rewards, margin and accuracy are
those of the averaged rewards. Response lengths are counted from the batch's own target tokens, whatever
its layout (lorakit.data.pair_collate).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lorakit.data.collate import IGNORE_INDEX


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from summed log-probabilities and token counts."""
    chosen = beta * policy_chosen / chosen_tokens.clamp_min(1)
    rejected = beta * policy_rejected / rejected_tokens.clamp_min(1)
    z = chosen - rejected - gamma
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, chosen.detach(), rejected.detach()


def response_tokens(batch: dict[str, Any], encoder_decoder: bool) -> torch.Tensor:
    """(2 x pairs,) scored tokens of each response, chosen and rejected of each pair in turn (fp32)."""
    n = 2 * batch["num_pairs"]
    if encoder_decoder and "source_segments" in batch:
        # Packed pairs (lorakit.data.pair_collate): one decoder row a side, pair k in segment k + 1.
        sides = []
        for s in ("chosen", "rejected"):
            scored = batch[f"{s}_labels"] != IGNORE_INDEX
            segments = batch[f"{s}_target_segments"][scored] - 1
            sides.append(torch.bincount(segments, minlength=batch["num_pairs"]))
        return torch.stack(sides, dim=1).reshape(-1).float()
    if encoder_decoder:
        sides = [(batch[f"{s}_labels"] != IGNORE_INDEX).sum(1) for s in ("chosen", "rejected")]
        return torch.stack(sides, dim=1).reshape(-1).float()
    if "target_sequence" in batch:  # shared-prompt rows: one entry per scored token
        return torch.bincount(batch["target_sequence"], minlength=n).float()
    scored = (batch["labels"] != IGNORE_INDEX).reshape(-1).float()
    return torch.zeros(n).index_add(0, batch["sequence_ids"].reshape(-1), scored)
