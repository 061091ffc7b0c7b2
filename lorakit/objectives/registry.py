"""The registry of training objectives, keyed by `train.objective`.

The built-ins are listed here; `register(Cls)` adds one (its spec too, so a recipe naming it validates).
Callers ask for the recipe's objective (objective_type, make_objective) or go through it (prepare_data,
make_batching): nothing outside lorakit.objectives compares an objective's name.
"""

from __future__ import annotations

from lorakit.errors import RecipeError
from lorakit.objectives.base import Objective
from lorakit.objectives.dpo import DpoObjective
from lorakit.objectives.kto import KtoObjective
from lorakit.objectives.orpo import OrpoObjective
from lorakit.objectives.sft import SftObjective
from lorakit.recipe.known_objectives import register_spec, unregister_spec

_BUILT_IN: dict[str, type[Objective]] = {
    cls.spec.name: cls for cls in (SftObjective, DpoObjective, OrpoObjective, KtoObjective)
}
# The process's objectives: the built-ins, and any registered since (a registry: mutable by design).
_OBJECTIVES: dict[str, type[Objective]] = dict(_BUILT_IN)


def register(objective: type[Objective]) -> type[Objective]:
    """Make `objective` trainable under `objective.spec.name` (train.objective); returns it, so it can
    decorate the class. ValueError when the name is taken by another objective."""
    name = objective.spec.name
    held = _OBJECTIVES.get(name)
    if held is not None and held is not objective:
        raise ValueError(f"train.objective {name!r} is already registered ({held.__qualname__})")
    register_spec(objective.spec)
    _OBJECTIVES[name] = objective
    return objective


def unregister(name: str) -> None:
    """Forget a registered objective (the built-ins stay)."""
    if name not in _BUILT_IN:
        _OBJECTIVES.pop(name, None)
        unregister_spec(name)


def objective_named(name: str) -> type[Objective]:
    """The objective registered as `name`; RecipeError naming train.objective and the known ones."""
    found = _OBJECTIVES.get(name)
    if found is None:
        raise RecipeError(
            f"train.objective {name!r}: no such objective; known: {', '.join(sorted(_OBJECTIVES))} "
            "(lorakit.objectives.register adds one)"
        )
    return found


def objective_type(recipe) -> type[Objective]:
    """The objective class of `recipe`'s train.objective."""
    return objective_named(recipe.train.objective)


def make_objective(recipe, config) -> Objective:
    """The recipe's train.objective for a model of `config` (encoder-decoder or causal)."""
    return objective_type(recipe).from_recipe(recipe, config)


def prepare_data(recipe, tokenizer, config):
    """Load, tokenize and cache the recipe's rows as its objective reads them (PreparedData)."""
    return objective_type(recipe).prepare_data(recipe, tokenizer, config)


def make_batching(recipe, data, tokenizer, config, **how):
    """Sampler and collators for `data`, as the recipe's objective batches its rows (`how`: packing, world,
    rank, share_prompt_problem; lorakit.data.batching.make_batching says what each means)."""
    return objective_type(recipe).make_batching(recipe, data, tokenizer, config, **how)
