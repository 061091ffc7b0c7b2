"""The recipe's registry of training objectives: name -> its ObjectiveSpec and the model of its settings.

It starts with the default objective (SFT, train.objective's default) alone; lorakit.objectives fills it: the built-ins when the lorakit package is imported, a plugin
through lorakit.objectives.register, each with the pydantic model of its own settings (or none), which a
recipe holds as the top-level section named after the objective. The recipe validates train.objective and
those sections against what is registered here, so it names no objective itself, and a registry (filled
from above) is how it learns of them without importing the floor above it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from lorakit import errors
from lorakit.recipe.objective_spec import SFT, ObjectiveSpec


@dataclass(frozen=True)
class Registered:
    """An objective as the recipe knows it: its spec, and the model of its section (None: no settings)."""

    spec: ObjectiveSpec
    settings: type[BaseModel] | None = None


# The process's objectives (a registry: mutable by design; lorakit.objectives fills it). The default is
# here from the start, as the schema's defaults are validated when the schema is defined.
_REGISTERED: dict[str, Registered] = {SFT.name: Registered(SFT)}


def register_spec(spec: ObjectiveSpec, settings: type[BaseModel] | None = None) -> None:
    """Make `spec.name` a valid train.objective, and with `settings` a valid top-level recipe section of
    that name, validated by that model. ValueError when another spec or model holds the name."""
    entry = Registered(spec, settings)
    held = _REGISTERED.get(spec.name)
    if held is not None and held != entry:
        raise ValueError(f"train.objective {spec.name!r} is already registered with another spec or settings")
    _REGISTERED[spec.name] = entry
    if settings is not None:
        errors.add_recipe_section(spec.name)


def unregister_spec(name: str) -> None:
    """Forget a registered objective and its section."""
    if _REGISTERED.pop(name, None) is not None:
        errors.remove_recipe_section(name)


def known_names() -> list[str]:
    """Every valid train.objective, sorted."""
    return sorted(_REGISTERED)


def spec_named(name: str) -> ObjectiveSpec:
    """The spec of objective `name`; ValueError listing the known ones."""
    entry = _REGISTERED.get(name)
    if entry is None:
        raise ValueError(
            f"unknown objective {name!r}; known: {', '.join(known_names())} "
            "(lorakit.objectives.register adds one)"
        )
    return entry.spec


def settings_model(name: str) -> type[BaseModel] | None:
    """The model of objective `name`'s section; None when it has no settings or is not registered."""
    entry = _REGISTERED.get(name)
    return None if entry is None else entry.settings


def settings_sections() -> list[tuple[str, type[BaseModel]]]:
    """(section name, model) of every registered objective with settings, in registration order."""
    return [(name, e.settings) for name, e in _REGISTERED.items() if e.settings is not None]


def objective_code(raw: Any) -> dict[str, str]:
    """{dotted field: code reference} of the code the objectives' sections of a raw recipe mapping name: a
    settings model declares its code fields with a classmethod `named_code(raw_section)` ({key: reference}),
    which recipe.read_back's trust rule applies as to its own fields."""
    found: dict[str, str] = {}
    for name, model in settings_sections():
        declare = getattr(model, "named_code", None)
        if declare is not None and isinstance(raw, dict) and name in raw:
            found |= {f"{name}.{key}": ref for key, ref in declare(raw[name]).items()}
    return found


def import_objective_module(module: str | None) -> None:
    """Import `module` (train.objective_module), which registers a plugin objective with
    lorakit.objectives.register. Called by the recipe loader for the caller's own recipe only, before
    validation (which imports nothing); ValueError naming the field when it cannot be imported."""
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"train.objective_module {module!r} cannot be imported: {e}") from None


def section_of(recipe) -> BaseModel | None:
    """The settings of `recipe`'s objective (its section, by default its model's defaults), or None."""
    name = recipe.train.objective
    spec_named(name)
    model = settings_model(name)
    if model is None:
        return None
    found = (recipe.model_extra or {}).get(name)
    return found if found is not None else model()


def spec_of(recipe) -> ObjectiveSpec:
    """The spec of `recipe`'s train.objective."""
    return spec_named(recipe.train.objective)


def specs() -> tuple[ObjectiveSpec, ...]:
    """Every registered spec, by name."""
    return tuple(_REGISTERED[name].spec for name in known_names())


def objective_sections(raw: dict[str, Any], declared, objective: Any) -> tuple[dict[str, Any], list[dict]]:
    """(`raw` with every key outside `declared` (the schema's own sections) validated as the section of the
    registered objective it names, and the section of `objective` (the recipe's train.objective, as given)
    filled with its defaults when absent; the pydantic line errors of the rest: an unknown key, or a
    section's own errors located at `SECTION.key`)."""
    out: dict[str, Any] = {}
    problems: list[dict] = []
    for key, value in raw.items():
        if key in declared:
            out[key] = value
            continue
        model = settings_model(key)
        if model is None:
            problems.append({"type": "extra_forbidden", "loc": (key,), "input": value})
            continue
        try:
            out[key] = value if isinstance(value, model) else model.model_validate(value)
        except ValidationError as e:
            problems += [_located(key, line) for line in e.errors()]
    model = settings_model(objective) if isinstance(objective, str) else None
    if model is not None and objective not in raw:
        try:
            out[objective] = model()
        except ValidationError as e:
            problems += [_located(objective, line) for line in e.errors()]
    return out, problems


def _located(section: str, line: dict) -> dict:
    """A section's line error as the recipe's: its location one dotted name (`SECTION.key`), since callers
    that walk the schema's declared fields to name a location would not find the section among them."""
    located = {"type": line["type"], "loc": (".".join([section, *map(str, line["loc"])]),)}
    located["input"] = line.get("input")
    if line.get("ctx"):
        located["ctx"] = line["ctx"]
    return located


def check_objective(recipe) -> None:
    """ValueError for what the recipe's objective refuses, and for another objective's section set."""
    spec = spec_of(recipe)
    for name, value in (recipe.model_extra or {}).items():
        if name != spec.name and value != type(value)():
            raise ValueError(
                f"the {name} section is read only with train.objective: {name}; set it or remove {name}"
            )
    if spec.check is not None:
        spec.check(recipe)
