"""A plugin objective with settings of its own, as a user's package would ship it: this one module, its
registration at the end. train.objective: scaled_tokens, configured in the recipe's `scaled_tokens:`
section (tests/unit/test_objective_settings.py)."""

from __future__ import annotations

from pydantic import Field

from lorakit.objectives import Objective, register
from lorakit.objectives.sft import causal_loss_sum
from lorakit.recipe.objective_spec import ObjectiveSpec
from lorakit.recipe.section import Section

NAME = "scaled_tokens"


class ScaledSettings(Section):
    """A toy objective (train.objective: scaled_tokens): scale x the token cross-entropy."""

    scale: float = Field(2.0, gt=0, description="What the summed token cross-entropy is multiplied by.")


class ScaledTokens(Objective):
    """scaled_tokens.scale x the summed token cross-entropy; divisor: target tokens. Reports `ce`."""

    spec = ObjectiveSpec(name=NAME, loss_label=NAME)

    def __init__(self, scale: float):
        self.scale = scale

    @classmethod
    def from_recipe(cls, recipe, config) -> ScaledTokens:
        return cls(recipe.scaled_tokens.scale)

    def units(self, batch):
        return batch["num_target_tokens"]

    def loss(self, engine, inputs, batch, device):
        ce = causal_loss_sum(engine, inputs, batch, device)
        return self.scale * ce, {"ce": ce.detach()}

    @classmethod
    def method_options(cls, recipe) -> list[str]:
        return [f"{NAME} scale={recipe.scaled_tokens.scale:g}"]


register(ScaledTokens, ScaledSettings)
