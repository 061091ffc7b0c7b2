"""The registry of training objectives, keyed by `train.objective`.

An objective is registered with the model of its settings, as peft registers a tuner with its config class:
`register(Cls, Settings)` makes `Cls.spec.name` a valid train.objective and `Settings` the recipe's section of
that name (lorakit.recipe.known_objectives validates it). The built-ins (builtin.py) are registered the same
way when lorakit.objectives is imported, their classes loaded on first use. Callers ask for the recipe's
objective (objective_type, make_objective) or go through it (prepare_data, make_batching): nothing outside
lorakit.objectives compares an objective's name.
"""

from __future__ import annotations

import importlib

from pydantic import BaseModel

from lorakit.errors import RecipeError
from lorakit.objectives.base import Objective
from lorakit.objectives.builtin import BUILT_IN
from lorakit.recipe.known_objectives import register_spec, unregister_spec

# The process's objectives: a class, or `module:Class` of a built-in not loaded yet (a registry: mutable by
# design).
_OBJECTIVES: dict[str, type[Objective] | str] = {}


def register_built_ins() -> None:
    """Register the objectives lorakit ships, with their settings (idempotent; torch-free)."""
    for b in BUILT_IN:
        register_spec(b.spec, b.settings)
        _OBJECTIVES.setdefault(b.spec.name, b.where)


def register(objective: type[Objective], settings: type[BaseModel] | None = None) -> type[Objective]:
    """Make `objective` trainable under `objective.spec.name` (train.objective), with `settings` (a pydantic
    model, best a lorakit.recipe.section.Section) validating the recipe's top-level section of that name,
    which the objective reads as `recipe.NAME` (known_objectives.section_of). Returns `objective`.
    ValueError when the name is taken by another objective or settings model. Registering may happen at
    any time before a recipe naming the objective is validated."""
    name = objective.spec.name
    held = _OBJECTIVES.get(name)
    if held is not None and held is not objective:
        shown = held if isinstance(held, str) else held.__qualname__
        raise ValueError(f"train.objective {name!r} is already registered ({shown})")
    register_spec(objective.spec, settings)
    _OBJECTIVES[name] = objective
    return objective


def unregister(name: str) -> None:
    """Forget a registered objective and its section (the built-ins stay)."""
    if name not in {b.spec.name for b in BUILT_IN}:
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
    if isinstance(found, str):
        module, _, cls = found.partition(":")
        found = _OBJECTIVES[name] = getattr(importlib.import_module(module), cls)
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
