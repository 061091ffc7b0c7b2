"""Recipe files: YAML in, dotted CLI overrides, one validated Recipe out, and the resolved dump."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lorakit.errors import RecipeError
from lorakit.recipe.schema import Recipe


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"override {item!r}: expected KEY=VALUE, e.g. train.lr=2e-4")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {item!r}: the key must be dotted names, e.g. train.lr")
    # YAML parsing gives overrides the same types a recipe file would: 2e-4 -> float, [q, v] -> list.
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(f"override {item!r}: value is not valid YAML: {e}") from None
    # PyYAML reads 2e-4 (no dot) as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with dotted `KEY=VALUE` overrides applied."""
    out = _deep_copy(raw)
    for item in overrides:
        path, value = _parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise RecipeError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, each naming the dotted field."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/recipes.md for every key)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {loc or 'recipe'}: {msg}")
    return "invalid recipe:\n" + "\n".join(lines)


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Validate a plain dict into a frozen Recipe, raising RecipeError with field names."""
    if not isinstance(raw, dict):
        raise RecipeError("invalid recipe: the top level must be a mapping of sections (model, data, ...)")
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e)) from None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML file, apply dotted overrides (`train.lr=2e-4`), and validate it."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    return recipe_from_dict(apply_overrides(raw, overrides))


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
