"""SFT (train.objective sft): token-weighted cross-entropy on the target tokens (labels != -100).

Its rows, batching and evaluation are the Objective defaults (lorakit.data.pipeline, lorakit.data.batching,
lorakit.evaluation.runner); its divisor is the window's target tokens on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.engine.loss import token_loss_sum
from lorakit.objectives.base import Objective
from lorakit.recipe.objective_spec import SFT as SFT_SPEC


class SftObjective(Objective):
    """Token-weighted cross-entropy on the target tokens (labels != -100)."""

    spec = SFT_SPEC

    def units(self, batch: dict[str, Any]) -> int:
        return batch["num_target_tokens"]

    def loss(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, dict[str, Any]]:
        return causal_loss_sum(engine, inputs, batch, device), {}


def causal_loss_sum(engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
    """Summed fp32 cross-entropy of a batch's target tokens: through the tiled loss head when the model has
    one (model.tiled_loss: no logits of the whole row), else over the logits in chunks (engine/loss.py)."""
    if getattr(inputs, "loss_head", None) is not None:
        return inputs.token_losses(engine, batch, device).sum()
    logits = inputs.logits(engine, batch, device)
    return token_loss_sum(logits, batch["labels"].to(device))


# The loop's default objective.
SFT = SftObjective()
