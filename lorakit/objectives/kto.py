"""KTO (train.objective kto): Kahneman-Tversky optimization on unpaired desirable/undesirable completions.

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") scores each row's
completion y by its log-ratio r = log pi(y|x) - log ref(y|x) (summed over tokens) against a reference
point z0, the policy's KL from the reference, estimated from MISMATCHED prompt/completion pairs (x_i with
another row's completion y'): z0 = max(0, mean over the micro-batch of log pi(y'|x) - log ref(y'|x)),
detached. With beta kto.beta and the weights kto.desirable_weight (lambda_D), kto.undesirable_weight
(lambda_U), the loss of a row is

    desirable:    lambda_D (1 - sigmoid(beta (r - z0)))
    undesirable:  lambda_U (1 - sigmoid(beta (z0 - r)))

summed over rows; divisor: rows. Rewards are beta r. The mean is over the micro-batch's rows on its rank
(TRL gathers it over ranks; a rank's own micro-batch keeps the loss free of collectives).

A row rides in the `unpaired` layout (lorakit.data.unpaired), shaped as a preference pair: its completion where DPO's chosen
response is and its mismatched completion where the rejected one is, so one forward scores both, with
DPO's layouts (packed, shared prompt, T5) and DPO's reference: the base with the adapter off, or for full
fine-tuning the initial model's log-probabilities cached before training (lorakit.objectives.dpo_reference).
"""

from __future__ import annotations

from typing import Any

import torch

from lorakit import dist
from lorakit.data.pair_collate import LABELS
from lorakit.objectives.alignment_settings import KTO, KTO_STEP_METRICS
from lorakit.objectives.base import Passes
from lorakit.objectives.dpo import DpoObjective, cached_reference, model_kind, reference_model, sides


def kto_loss(
    policy: torch.Tensor,
    policy_kl: torch.Tensor,
    ref: torch.Tensor,
    ref_kl: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-row losses, rewards (detached), z0 (detached scalar)) from summed log-probabilities of each
    row's completion and mismatched completion under the policy and the reference; `desirable`: bool."""
    z0 = (policy_kl - ref_kl).mean().clamp_min(0).detach()
    r = policy - ref
    gain = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    loss_ = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(desirable, gain, loss_)
    return losses, beta * r.detach(), z0


def step_metric_sums(rewards: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor) -> dict[str, Any]:
    """Sums over rows of KTO_STEP_METRICS (a row of the other kind counts 0 in each kind's rewards)."""
    d = desirable.to(rewards.dtype)
    values = ((rewards * d).sum(), (rewards * (1 - d)).sum(), d.sum(), z0 * rewards.numel())
    return dict(zip(KTO_STEP_METRICS, values, strict=True))


class KtoObjective(DpoObjective):
    """The KTO loss over a batch of rows (DPO's layouts, the mismatched completion as the second sequence);
    divisor: rows (`num_pairs` of the layout)."""

    spec = KTO
    layout = "unpaired"

    def __init__(
        self,
        beta: float,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        *,
        encoder_decoder: bool,
        cached_reference: bool = False,
    ):
        super().__init__(beta, encoder_decoder=encoder_decoder, cached_reference=cached_reference)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    @classmethod
    def from_recipe(cls, recipe, config) -> KtoObjective:
        k = recipe.kto
        return cls(k.beta, k.desirable_weight, k.undesirable_weight, **model_kind(recipe, config))

    @classmethod
    def method_options(cls, recipe) -> list[str]:
        return [recipe.kto.label()]

    @classmethod
    def passes(cls, recipe) -> Passes:
        """Each row's completion and its mismatched completion; DPO's reference pass over both."""
        reference = "live" if recipe.method.adapter() else "before training"
        return Passes(2, reference)

    @classmethod
    def plan_notes(cls, recipe) -> list[str]:
        return [
            "train.objective kto: two sequences per row in every micro-batch (its completion and a "
            "mismatched one for the KL estimate), and DPO's reference pass over both"
        ]

    @classmethod
    def describe_plan(cls, no_grad_forward: str) -> str | None:
        return f"KTO: a completion and a mismatched (KL) one per row; the no-grad reference forward {no_grad_forward}"

    def row_terms(self, engine, inputs, batch: dict[str, Any], device):
        """(per-row losses, rewards, z0, labels) of one batch."""
        if self.cached_reference:
            ref = cached_reference(batch, device)
        else:
            with reference_model(engine):  # first, every rank alike (ZeRO-3's collective gathers)
                ref = self.log_probs(engine, inputs, batch, device)
        policy = self.log_probs(engine, inputs, batch, device)
        desirable = batch[LABELS].to(policy.device)
        losses, rewards, z0 = kto_loss(
            *sides(policy),
            *sides(ref.to(policy.dtype)),
            desirable,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        return losses, rewards, z0, desirable

    def loss(self, engine, inputs, batch: dict[str, Any], device) -> tuple[torch.Tensor, dict[str, Any]]:
        losses, rewards, z0, desirable = self.row_terms(engine, inputs, batch, device)
        return losses.sum(), step_metric_sums(rewards, desirable, z0)

    def evaluate(self, engine, inputs, recipe, data, tokenizer, collator, *, zero3: bool, generate=None):
        """The KTO loss, rewards of both kinds, their margin and z0 on the eval rows, padded, no generation."""
        from lorakit.data.pair_collate import pair_collators
        from lorakit.evaluation.runner import EvalOutcome

        config = getattr(engine, "module", engine).config
        batch_size = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
        padded = pair_collators(tokenizer, config, labels=True)
        rows = padded.wrap(padded.padded)
        return EvalOutcome(evaluate_unpaired(engine, inputs, self, data.eval, rows, batch_size))


@torch.no_grad()
def evaluate_unpaired(engine, inputs, objective: KtoObjective, eval_ds, collator, batch_size: int) -> dict:
    """Means over every eval row (the same on every rank) of the loss and KTO_STEP_METRICS, and `margin`:
    the mean reward of a desirable row minus that of an undesirable one (0 where a kind is missing)."""
    from lorakit.evaluation.generate import eval_plan

    model = getattr(engine, "module", engine)
    was_training = model.training
    model.eval()
    sums = torch.zeros(2 + len(KTO_STEP_METRICS), dtype=torch.float64)
    for rows, real in eval_plan(len(eval_ds), batch_size, dist.world_size(), dist.rank()):
        batch = collator([eval_ds[i] for i in rows])
        losses, rewards, z0, desirable = objective.row_terms(engine, inputs, batch, engine.device)
        if real:
            found = step_metric_sums(rewards[:real], desirable[:real], z0)
            values = [real, losses[:real].sum(), *(found[k] for k in KTO_STEP_METRICS)]
            sums += torch.tensor([float(v) for v in values], dtype=torch.float64)
    total, loss, *rest = dist.all_reduce(sums.tolist())
    model.train(was_training)
    n = max(total, 1.0)
    out = {"loss": loss / n} | {k: v / n for k, v in zip(KTO_STEP_METRICS, rest, strict=True)}
    share = out["desirable_share"]
    good = out["rewards/desirable"] / share if share > 0 else 0.0
    bad = out["rewards/undesirable"] / (1 - share) if share < 1 else 0.0
    out["margin"] = good - bad
    return out
