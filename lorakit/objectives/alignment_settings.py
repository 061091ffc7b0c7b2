"""The orpo and kto objectives' settings (the recipe's orpo and kto sections, registered with the objectives)
and their specs (lorakit.recipe.objective_spec; the objectives themselves are lorakit.objectives.orpo and
.kto). Torch-free, as dpo_settings.py.

ORPO reads preference pairs as DPO does (data.format instruction or chat for the prompt, two response
columns); KTO reads unpaired rows: a prompt, one completion and a desirable/undesirable label.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from lorakit.objectives.dpo_settings import DPO_METRICS, PairColumns, check_preference_rows, pair_spec
from lorakit.recipe.section import Section

# ORPO's step and evaluation numbers besides the loss: DPO's (rewards are lambda x mean token log-probability).
ORPO_METRICS = DPO_METRICS
# KTO's, in every step and evaluation record, means over all rows: rewards/desirable (undesirable) sums the
# rewards of the desirable (undesirable) rows, a row of the other kind counting 0; desirable_share is their
# share; kl is the reference point z0. The evaluation adds `margin`, the mean reward of a desirable row minus
# that of an undesirable one (lorakit.objectives.kto).
KTO_STEP_METRICS = ("rewards/desirable", "rewards/undesirable", "desirable_share", "kl")
KTO_METRICS = (*KTO_STEP_METRICS, "margin")


class OrpoSection(PairColumns):
    """Odds-ratio preference optimization (train.objective: orpo; Hong, Lee & Thorne 2024): the SFT loss on
    the chosen response plus lambda x -log sigmoid(log odds(chosen) - log odds(rejected)), where odds(y) =
    P(y|x) / (1 - P(y|x)) over the mean token probability. No reference model, no reference pass: one stage
    instead of SFT then DPO. See docs/alignment.md."""

    key = "orpo"

    odds_ratio_weight: float = Field(
        0.1,
        gt=0,
        description="ORPO's lambda (TRL's beta): the weight of the odds-ratio term beside the SFT loss of "
        "the chosen response. The paper uses 0.1 to 0.25 at 7B.",
    )
    share_prompt: bool = Field(
        True,
        description="As dpo.share_prompt: causal LMs that pack hold each pair's prompt once in its row.",
    )

    def label(self) -> str:
        """summary.json's method_options entry (lorakit.compare): `orpo lambda=0.1`."""
        return f"orpo lambda={self.odds_ratio_weight:g}"


class KtoSection(Section):
    """Kahneman-Tversky optimization (train.objective: kto; Ethayarajh et al. 2024) on unpaired rows: a
    prompt (data.input_column through data.prompt_template; data.format instruction), one completion and a
    label, true (or 1) for a desirable completion, false (0) for an undesirable one. The reference is the
    base with the adapter off (method.kind full: the initial model, scored once and cached as for DPO);
    the reference point z0 is the policy's KL from it, estimated on mismatched prompt/completion pairs
    (each row's prompt with another row's completion), clamped at 0 and detached. See docs/alignment.md."""

    beta: float = Field(
        0.1,
        gt=0,
        description="As dpo.beta: rewards are beta x (policy - reference) summed log-probabilities.",
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_D: the weight of a desirable row's loss, 1 - sigmoid(beta x (log-ratio - z0)). "
        "With unbalanced data the paper keeps desirable_weight x desirable rows / (undesirable_weight x "
        "undesirable rows) between 1 and 4/3.",
    )
    undesirable_weight: float = Field(
        1.0,
        gt=0,
        description="lambda_U: the weight of an undesirable row's loss, 1 - sigmoid(beta x (z0 - log-ratio)).",
    )
    share_prompt: bool = Field(
        True,
        description="As dpo.share_prompt: causal LMs that pack hold a row's prompt once for its completion "
        "and its mismatched (KL) completion.",
    )
    completion_column: str = Field("completion", description="Column with the completion (text).")
    label_column: str = Field(
        "label", description="Column with the label: true or 1 (desirable), false or 0 (undesirable)."
    )

    def pair_columns(self) -> dict[str, str]:
        """{recipe field: column} a row must have besides its prompt."""
        return {"kto.completion_column": self.completion_column, "kto.label_column": self.label_column}

    def label(self) -> str:
        """summary.json's method_options entry: `kto beta=0.1` (and the weights when not 1)."""
        weights = (
            f" weights={self.desirable_weight:g}/{self.undesirable_weight:g}"
            if (self.desirable_weight, self.undesirable_weight) != (1.0, 1.0)
            else ""
        )
        return f"kto beta={self.beta:g}{weights}"

    @model_validator(mode="after")
    def _check(self) -> KtoSection:
        if self.completion_column == self.label_column:
            raise ValueError("kto.completion_column and kto.label_column name the same column")
        return self


def check_orpo(recipe) -> None:
    """ValueError for what train.objective orpo cannot be combined with."""
    check_preference_rows(recipe, "orpo", "a pair's responses", reference=False)


def check_kto(recipe) -> None:
    """ValueError for what train.objective kto cannot be combined with."""
    check_preference_rows(recipe, "kto", "completions", reference=True)


ORPO = pair_spec("orpo", check_orpo, ORPO_METRICS, "each preference pair's sequences")
KTO = pair_spec("kto", check_kto, KTO_METRICS, "each row's completion and its mismatched completion")
