"""The registry of objective specs that `train.objective` is validated against (name -> ObjectiveSpec).

The built-in objectives are listed here; lorakit.objectives.register adds an objective's spec together
with the objective, so a recipe naming it validates. No code outside lorakit.objectives compares an
objective's name: it asks the spec (this module) or the objective (lorakit.objectives).
"""

from __future__ import annotations

import importlib

from lorakit.recipe.alignment_section import KTO, ORPO
from lorakit.recipe.dpo_section import DPO
from lorakit.recipe.objective_spec import SFT, ObjectiveSpec

_BUILT_IN = tuple(spec.name for spec in (SFT, DPO, ORPO, KTO))
# The process's objectives: the built-ins, and any registered since (a registry: mutable by design).
_SPECS: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (SFT, DPO, ORPO, KTO)}


def register_spec(spec: ObjectiveSpec) -> None:
    """Make `spec.name` a valid train.objective; ValueError when another spec holds the name."""
    held = _SPECS.get(spec.name)
    if held is not None and held != spec:
        raise ValueError(f"train.objective {spec.name!r} is already registered with another spec")
    _SPECS[spec.name] = spec


def unregister_spec(name: str) -> None:
    """Forget the spec of a registered objective (a built-in stays)."""
    if name not in _BUILT_IN:
        _SPECS.pop(name, None)


def known_names() -> list[str]:
    """Every valid train.objective, sorted."""
    return sorted(_SPECS)


def spec_named(name: str) -> ObjectiveSpec:
    """The spec of objective `name`; ValueError listing the known ones."""
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(
            f"unknown objective {name!r}; known: {', '.join(known_names())} "
            "(lorakit.objectives.register adds one)"
        )
    return spec


def import_objective_module(module: str | None) -> None:
    """Import `module` (train.objective_module), which registers a plugin objective with
    lorakit.objectives.register; every process that validates the recipe does, so the launcher's workers
    know the objective too. ValueError naming the field when it cannot be imported."""
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"train.objective_module {module!r} cannot be imported: {e}") from None


def section_of(recipe):
    """The recipe's section of its objective's own settings (recipe.dpo for dpo), or None."""
    section = spec_of(recipe).section
    return None if section is None else getattr(recipe, section)


def spec_of(recipe) -> ObjectiveSpec:
    """The spec of `recipe`'s train.objective."""
    return spec_named(recipe.train.objective)


def specs() -> tuple[ObjectiveSpec, ...]:
    """Every registered spec, by name."""
    return tuple(_SPECS[name] for name in known_names())


def check_objective(recipe) -> None:
    """ValueError for what the recipe's objective refuses, and for another objective's section set."""
    spec = spec_of(recipe)
    for other in specs():
        if other.section is None or other.section == spec.section:
            continue
        value = getattr(recipe, other.section)
        if value != type(value)():
            raise ValueError(
                f"the {other.section} section is read only with train.objective: {other.name}; set it or "
                f"remove {other.section}"
            )
    if spec.check is not None:
        spec.check(recipe)
