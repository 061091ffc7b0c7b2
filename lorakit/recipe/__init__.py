"""Recipes: the strict schema and YAML loading with dotted overrides."""

from lorakit.recipe.load import apply_overrides, dump_recipe, load_recipe, recipe_from_dict
from lorakit.recipe.schema import Recipe

__all__ = ["Recipe", "apply_overrides", "dump_recipe", "load_recipe", "recipe_from_dict"]
