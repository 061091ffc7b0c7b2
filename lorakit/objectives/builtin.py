"""The objectives lorakit ships, as the registry lists them before any is loaded: each one's spec, the model
of its settings (its recipe section) and where its Objective class lives.

Torch-free, so that importing lorakit registers them with the recipe (lorakit.recipe.known_objectives) and a
recipe naming one validates, its section included, without loading the objective itself; the class is
imported when a run first asks for it (lorakit.objectives.registry).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from lorakit.objectives.alignment_settings import KTO, ORPO, KtoSection, OrpoSection
from lorakit.objectives.dpo_settings import DPO, DpoSection
from lorakit.objectives.grpo_settings import GRPO, GrpoSection
from lorakit.recipe.objective_spec import SFT, ObjectiveSpec


@dataclass(frozen=True)
class BuiltIn:
    """A shipped objective: its spec, its settings model (None: none) and `module:Class` of its Objective."""

    spec: ObjectiveSpec
    settings: type[BaseModel] | None
    where: str


BUILT_IN = (
    BuiltIn(SFT, None, "lorakit.objectives.sft:SftObjective"),
    BuiltIn(DPO, DpoSection, "lorakit.objectives.dpo:DpoObjective"),
    BuiltIn(ORPO, OrpoSection, "lorakit.objectives.orpo:OrpoObjective"),
    BuiltIn(KTO, KtoSection, "lorakit.objectives.kto:KtoObjective"),
    BuiltIn(GRPO, GrpoSection, "lorakit.objectives.grpo:GrpoObjective"),
)
