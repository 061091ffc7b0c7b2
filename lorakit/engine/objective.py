"""Training objectives: what the loop backpropagates for one micro-batch, and what it is divided by.

The loop (lorakit.engine.loop.train_window) asks an objective for `units(batch)`, the count its loss is a
sum over (target tokens for SFT, preference pairs for DPO), and for `loss(engine, inputs, batch, device)`:
the summed loss of the micro-batch and metric sums over the same units (detached tensors). The window's
units are summed over ranks before the first backward, so every objective's gradient is that of one batch
holding the whole window, as for token-weighted SFT. `evaluate` (an objective's own evaluation, or None
for the generic one of lorakit.evaluation) is what Job.evaluate runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lorakit.engine.loss import token_loss_sum


class Objective(Protocol):
    """What train_window needs of an objective."""

    name: str

    def units(self, batch: dict[str, Any]) -> int:
        """The count the micro-batch's summed loss is a sum over (its share of the window's divisor)."""
        ...

    def loss(
        self, engine, inputs, batch: dict[str, Any], device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss with grad, {metric: detached sum over the same units})."""
        ...


class SftObjective:
    """Token-weighted cross-entropy on the target tokens (labels != -100)."""

    name = "sft"

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


SFT = SftObjective()


def make_objective(recipe, config) -> Objective:
    """The recipe's train.objective for a model of `config` (encoder-decoder or causal)."""
    if recipe.train.objective == "dpo":
        from lorakit.engine.dpo import DpoObjective

        d = recipe.dpo
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        return DpoObjective(
            d.beta,
            d.loss,
            d.label_smoothing,
            encoder_decoder=encoder_decoder,
            simpo_gamma=d.simpo_gamma,
            cached_reference=not recipe.method.adapter(),
        )
    return SFT
