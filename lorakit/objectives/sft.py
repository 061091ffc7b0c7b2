"""SFT (train.objective sft): token-weighted cross-entropy on the target tokens (labels != -100).

Its rows, batching and evaluation are the Objective defaults (the examples layout: lorakit.data.examples, lorakit.data.batching,
lorakit.evaluation.runner); its divisor is the window's target tokens on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit.model.loss import token_loss_sum
from lorakit.model.router import RouterLoss, capture_router_logits, router_loss_of
from lorakit.objectives.base import Objective
from lorakit.recipe.objective_spec import SFT as SFT_SPEC


class SftObjective(Objective):
    """Token-weighted cross-entropy on the target tokens (labels != -100); on a mixture-of-experts model,
    plus the router's load-balancing loss (lorakit.model.router) weighted by the same tokens."""

    spec = SFT_SPEC

    def __init__(self, router: RouterLoss | None = None):
        self.router = router

    @classmethod
    def from_recipe(cls, recipe, config) -> SftObjective:
        return cls(router_loss_of(config))

    def units(self, batch: dict[str, Any]) -> int:
        return batch["num_target_tokens"]

    def loss(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.router is None:
            return causal_loss_sum(engine, inputs, batch, device), {}
        module = getattr(engine, "module", engine)
        with capture_router_logits(module, self.router.router_classes) as logits:
            loss_sum = causal_loss_sum(engine, inputs, batch, device)
        # The micro-batch's aux loss times its target tokens: the loop's division by the window's tokens
        # on every rank makes it the token-weighted mean over micro-batches and ranks.
        aux = self.router(logits, batch) * self.units(batch)
        return loss_sum + self.router.coef * aux, {"aux_loss": aux.detach()}


def causal_loss_sum(engine, inputs, batch: dict[str, Any], device) -> torch.Tensor:
    """Summed fp32 cross-entropy of a batch's target tokens: through the tiled loss head when the model has
    one (model.tiled_loss: no logits of the whole row), else over the logits in chunks (model/loss.py)."""
    if getattr(inputs, "loss_head", None) is not None:
        return inputs.token_losses(engine, batch, device).sum()
    logits = inputs.logits(engine, batch, device)
    return token_loss_sum(logits, batch["labels"].to(device))


# The loop's default objective.
SFT = SftObjective()
