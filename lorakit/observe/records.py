"""What the tracking backends get from a metric record and from the recipe, shared by their sinks.

A record (`kind`, `step`, `epoch`, numbers) becomes scalars named `KIND/NAME` (`train/loss`,
`eval/rouge1`) at the record's optimizer step; the resolved recipe becomes flat `section.key` parameters.
"""

from __future__ import annotations

import json
from typing import Any

# Not scalars: the record's kind and its x-axis.
_AXES = ("kind", "step")


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {`kind/name`: value}) of a metric record: every number in it (booleans as 0/1, None left
    out), under the record's kind."""
    kind, step = record.get("kind", "train"), int(record["step"])
    out = {}
    for name, value in record.items():
        if name in _AXES or value is None:
            continue
        if isinstance(value, bool | int | float):
            out[f"{kind}/{name}"] = float(value)
    return step, out


def flat_params(recipe: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The resolved recipe (`Recipe.model_dump(mode="json")`) as `section.key` -> value, with lists,
    mappings-in-lists and None written as JSON text (what every backend's parameter table can show)."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in recipe.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out
