"""The recipe's dpo section (train.objective dpo: preference tuning) and its cross-section checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section

if TYPE_CHECKING:
    from lorakit.recipe.schema import Recipe

# The numbers a DPO step and evaluation report besides the loss (means over the pairs).
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "margin", "accuracy")


class DpoSection(Section):
    """Direct preference optimization (train.objective: dpo): the policy learns to prefer the chosen
    response over the rejected one relative to a reference model: the base with the adapter turned off,
    or with method.kind full the initial model, its log-probabilities computed once before training and
    cached with the dataset. See docs/dpo.md."""

    beta: float = Field(
        0.1,
        gt=0,
        description="Strength of the pull towards the reference: the rewards are beta x (policy - reference) "
        "summed log-probabilities of a response. Smaller lets the policy move further from the base.",
    )
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: DPO's -log sigmoid(beta x (chosen log-ratio - rejected log-ratio)); ipo: "
        "(log-ratio difference - 1 / (2 beta))^2, which stops pushing once the margin is reached. Log-ratios "
        "are of summed (not averaged) response log-probabilities.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="sigmoid: the share of pairs assumed mislabelled (conservative DPO): the loss mixes in "
        "that much of the reversed preference. 0: off.",
    )
    chosen_column: str = Field("chosen", description="Column with the preferred response (text).")
    rejected_column: str = Field("rejected", description="Column with the dispreferred response (text).")

    @model_validator(mode="after")
    def _check(self) -> DpoSection:
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("dpo.label_smoothing applies to loss sigmoid only; set it to 0 with loss ipo")
        if self.chosen_column == self.rejected_column:
            raise ValueError("dpo.chosen_column and dpo.rejected_column name the same column")
        return self


def check_objective(recipe: Recipe) -> None:
    """ValueError for what train.objective dpo cannot be combined with (and for a dpo section without it)."""
    if recipe.train.objective != "dpo":
        if recipe.dpo != DpoSection():
            raise ValueError("the dpo section is read only with train.objective: dpo; set it or remove dpo")
        return
    method, data = recipe.method, recipe.data
    if method.lora() and method.init in ("pissa", "olora"):
        raise ValueError(
            f"method.init {method.init} rewrites the base weights, so the base with the adapter turned off is "
            "no longer the reference model train.objective dpo compares against; use init default or gaussian"
        )
    if isinstance(data.source, list):
        raise ValueError("train.objective dpo reads one data.source of preference pairs, not a mixture")
    if data.format == "completion":
        raise ValueError(
            "train.objective dpo: data.format completion has no prompt; use instruction (data.input_column "
            "through data.prompt_template) or chat (data.messages_column holds the prompt's messages)"
        )
    if data.train_on_inputs:
        raise ValueError(
            "data.train_on_inputs: DPO compares responses only; remove it with train.objective dpo"
        )
    if recipe.eval_active() and recipe.eval.generate:
        raise ValueError(
            "eval.generate: a DPO evaluation reports the preference loss, rewards, margin and accuracy of the "
            "eval pairs, not generations; set eval.generate: false"
        )
