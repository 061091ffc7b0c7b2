"""ORPO (train.objective orpo): odds-ratio preference optimization, one stage, no reference model.

ORPO (Hong, Lee & Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference Model") adds to
the SFT loss of the chosen response a penalty on the log odds ratio of chosen over rejected. With P(y|x)
the mean token probability of response y, exp(log P(y|x) / |y|), odds(y) = P / (1 - P) and lambda
orpo.odds_ratio_weight, the loss of a pair is

    nll - lambda log sigmoid(log odds(chosen) - log odds(rejected)),     nll = -log P(chosen|x) / |chosen|

i.e. the SFT term of a pair is its chosen response's mean token cross-entropy, so the divisor is pairs (as
for DPO) and a pair's weight does not depend on its length; log(1 - P) is computed as log(-expm1(log P)).
Rewards are lambda x the mean token log-probability (TRL's), accuracy counts pairs whose chosen reward is
the larger one. Pairs are read, batched (packed, shared prompt, T5) and evaluated as DPO's
(lorakit.objectives.dpo); no pass ever turns the adapter off, so full fine-tuning needs no cached reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lorakit.objectives.alignment_settings import ORPO
from lorakit.objectives.base import Passes
from lorakit.objectives.dpo import DpoObjective, metric_sums, sides
from lorakit.objectives.simpo import response_tokens


def log_odds(mean_log_prob: torch.Tensor) -> torch.Tensor:
    """log (P / (1 - P)) of P = exp(mean_log_prob) <= 1, without forming 1 - P (stable near P = 1)."""
    return mean_log_prob - torch.log(-torch.expm1(mean_log_prob))


def orpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    weight: float,
) -> tuple[torch.Tensor, ...]:
    """(per-pair losses, chosen rewards, rejected rewards, nll, log odds ratio) from summed response
    log-probabilities and token counts; the last four detached."""
    chosen = policy_chosen / chosen_tokens.clamp_min(1)
    rejected = policy_rejected / rejected_tokens.clamp_min(1)
    ratio = log_odds(chosen) - log_odds(rejected)
    losses = -chosen - weight * F.logsigmoid(ratio)
    return losses, weight * chosen.detach(), weight * rejected.detach(), -chosen.detach(), ratio.detach()


class OrpoObjective(DpoObjective):
    """The ORPO loss over a batch of pairs (DPO's layouts); divisor: pairs. No reference pass."""

    spec = ORPO

    def __init__(self, weight: float, *, encoder_decoder: bool):
        # Of DPO it keeps the pair layouts and log-probabilities only: no beta, loss variant or reference
        # (DpoObjective.__init__'s), so nothing of DPO's loss can read the odds-ratio weight by mistake.
        self.weight, self.encoder_decoder = weight, encoder_decoder
        self.cached_reference = False  # no reference model, full fine-tuning included

    @classmethod
    def from_recipe(cls, recipe, config) -> OrpoObjective:
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        return cls(recipe.orpo.odds_ratio_weight, encoder_decoder=encoder_decoder)

    def prepare_training(self, recipe, engine, inputs, source: str, data, collator):
        return data  # no reference model: nothing to compute before training

    @classmethod
    def evaluation_data(cls, recipe, source: str, data):
        return data

    @classmethod
    def method_options(cls, recipe) -> list[str]:
        return [recipe.orpo.label()]

    @classmethod
    def passes(cls, recipe) -> Passes:
        return Passes(2, None)

    @classmethod
    def plan_notes(cls, recipe) -> list[str]:
        return ["train.objective orpo: two sequences per pair in every micro-batch; no reference pass"]

    @classmethod
    def describe_plan(cls, no_grad_forward: str) -> str | None:
        return "ORPO: two sequences per pair, no reference forward"

    def terms(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, ...]:
        """orpo_loss of one batch."""
        policy = self.log_probs(engine, inputs, batch, device)
        tokens = response_tokens(batch, self.encoder_decoder).to(policy.device)
        return orpo_loss(*sides(policy), *sides(tokens), weight=self.weight)

    def pair_terms(self, engine, inputs, batch: dict[str, Any], device):
        """(per-pair losses, chosen rewards, rejected rewards): what DPO's evaluation reads."""
        return self.terms(engine, inputs, batch, device)[:3]

    def loss(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, dict[str, Any]]:
        losses, chosen, rejected, nll, ratio = self.terms(engine, inputs, batch, device)
        return losses.sum(), metric_sums(chosen, rejected) | {"nll": nll.sum(), "log_odds_ratio": ratio.sum()}
