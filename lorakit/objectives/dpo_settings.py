"""The dpo objective's settings (the recipe's dpo section, registered with the objective: preference tuning),
its cross-section checks and its spec (lorakit.recipe.objective_spec; the objective itself is
lorakit.objectives.dpo). Torch-free: the recipe validates it without loading the objective."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from lorakit.recipe.objective_spec import ObjectiveSpec
from lorakit.recipe.section import Section

# The numbers a DPO step and evaluation report besides the loss (means over the pairs).
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "margin", "accuracy")


class PairColumns(Section):
    """The columns of a preference pair's two responses (the dpo and orpo sections)."""

    # The section's name in the recipe, for the fields' names in messages.
    key: ClassVar[str]

    chosen_column: str = Field("chosen", description="Column with the preferred response (text).")
    rejected_column: str = Field("rejected", description="Column with the dispreferred response (text).")

    def pair_columns(self) -> dict[str, str]:
        """{recipe field: column} of the two responses a pair row must have."""
        return {
            f"{self.key}.chosen_column": self.chosen_column,
            f"{self.key}.rejected_column": self.rejected_column,
        }

    @model_validator(mode="after")
    def _distinct_columns(self) -> PairColumns:
        if self.chosen_column == self.rejected_column:
            raise ValueError(f"{self.key}.chosen_column and {self.key}.rejected_column name the same column")
        return self


class DpoSection(PairColumns):
    """Direct preference optimization (train.objective: dpo): the policy learns to prefer the chosen
    response over the rejected one relative to a reference model: the base with the adapter turned off,
    or with method.kind full the initial model, its log-probabilities computed once before training and
    cached with the dataset. See docs/dpo.md."""

    key = "dpo"

    beta: float = Field(
        0.1,
        gt=0,
        description="Strength of the pull towards the reference: the rewards are beta x (policy - reference) "
        "summed log-probabilities of a response. Smaller lets the policy move further from the base.",
    )
    loss: Literal["sigmoid", "ipo", "simpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO's -log sigmoid(beta x (chosen log-ratio - rejected log-ratio)); ipo: "
        "(log-ratio difference - 1 / (2 beta))^2, which stops pushing once the margin is reached. Log-ratios "
        "are of summed (not averaged) response log-probabilities. simpo: reference-free, -log sigmoid(beta x "
        "(chosen - rejected mean token log-probability) - dpo.simpo_gamma), no pass with the adapter off; "
        "its rewards are beta x the mean token log-probability, and SimPO's authors use beta 2 to 10.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="sigmoid and simpo: the share of pairs assumed mislabelled (conservative DPO): the loss "
        "mixes in that much of the reversed preference. 0: off.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="loss simpo: the target margin between the chosen and the rejected reward (SimPO's gamma, "
        "in reward units: beta x mean token log-probability).",
    )
    share_prompt: bool = Field(
        True,
        description="Causal LMs that pack: each pair takes one segment of its packed row, prompt then chosen "
        "then rejected, the rejected tokens attending to the prompt but never to the chosen ones, so the "
        "prompt is computed and counted once. false: prompt + chosen and prompt + rejected as two sequences. "
        "The flash_attention_2 backend cannot share it and packs the two (said at start).",
    )

    def label(self) -> str:
        """How summary.json's method_options (and so lorakit.compare) name the objective: `dpo beta=0.1`,
        `dpo ipo beta=0.1`, `dpo simpo beta=2 gamma=0.5`."""
        loss = "" if self.loss == "sigmoid" else f"{self.loss} "
        gamma = f" gamma={self.simpo_gamma:g}" if self.loss == "simpo" else ""
        return f"dpo {loss}beta={self.beta:g}{gamma}"

    @model_validator(mode="after")
    def _check(self) -> DpoSection:
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError(
                "dpo.label_smoothing applies to loss sigmoid (and simpo) only; set it to 0 with loss ipo"
            )
        # By value, not by whether it was given: a resolved recipe.yaml spells every default out.
        if self.loss != "simpo" and self.simpo_gamma != type(self).model_fields["simpo_gamma"].default:
            raise ValueError("dpo.simpo_gamma applies to loss simpo only; remove it or set dpo.loss: simpo")
        return self


def check_dpo(recipe) -> None:
    """ValueError for what train.objective dpo cannot be combined with (`recipe`: the validated Recipe)."""
    check_preference_rows(recipe, "dpo", "responses", reference=True)


def check_preference_rows(recipe, name: str, scored: str, *, reference: bool) -> None:
    """ValueError for what an objective scoring `scored` after a prompt cannot be combined with (dpo, orpo,
    kto); `reference`: whether it compares against the base with the adapter off."""
    method, data = recipe.method, recipe.data
    if reference and method.lora() and method.init in ("pissa", "olora"):
        raise ValueError(
            f"method.init {method.init} rewrites the base weights, so the base with the adapter turned off is "
            f"no longer the reference model train.objective {name} compares against; use init default or "
            "gaussian"
        )
    if isinstance(data.source, list):
        raise ValueError(f"train.objective {name} reads one data.source of its rows, not a mixture")
    if data.format == "completion":
        raise ValueError(
            f"train.objective {name}: data.format completion has no prompt; use instruction (data.input_column "
            "through data.prompt_template) or chat (data.messages_column holds the prompt's messages)"
        )
    if data.train_on_inputs:
        raise ValueError(
            f"data.train_on_inputs: {name} scores {scored} only; remove it with train.objective {name}"
        )
    if recipe.eval_active() and recipe.eval.generate:
        raise ValueError(
            f"eval.generate: a {name} evaluation reports its loss, rewards and margins on the eval rows, not "
            "generations; set eval.generate: false"
        )


def pair_spec(name: str, check, eval_metrics: tuple[str, ...], kept: str) -> ObjectiveSpec:
    """The spec of an objective scoring preference-pair-shaped rows (dpo, orpo, kto): its loss needs each sequence's log-probabilities, and `kept` stays whole on one rank."""
    return ObjectiveSpec(
        name=name,
        check=check,
        eval_metrics=eval_metrics,
        no_tiled_loss="needs each sequence's log-probabilities from the logits",
        no_sequence_parallel=f"keeps {kept} whole on one rank",
        loss_label=name,
    )


DPO = pair_spec("dpo", check_dpo, DPO_METRICS, "each preference pair's sequences")
