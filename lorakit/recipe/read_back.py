"""Recipes lorakit reads back are data: a run directory's recipe.yaml, a model card's recipe, a downloaded
snapshot's. Whoever wrote that directory decides nothing about what runs here:

- trust (model.trust_remote_code, model.allow_pickle) comes from the caller (--trust-remote-code,
  --allow-pickle; trust_remote_code=, allow_pickle= in Python); a recipe read back that asks for trust the
  caller did not grant is refused, naming the field and the flag;
- code a recipe names (CODE_FIELDS: train.objective_module, data.transform; and the code fields an
  objective's settings declare, known_objectives.objective_code) is imported only when the caller names its
  module (--allow-code MODULE; allow_code=[MODULE] in Python); where the command needs
  that code and it is not named, the recipe is refused, naming the field and the flag;
- a server a recipe names to send data to (an objective's `named_servers`: online RL's rollout server,
  which is sent the adapter and the prompts) is contacted for a run directory's recipe.yaml (a resumed run) only when the
  caller confirms it (--allow-server URL, or the field set on the command line): check_servers.

A recipe the caller gives (the RECIPE of `python -m lorakit.run RECIPE`, a path or dict passed to
lorakit.load_recipe / recipe_from_dict) is the caller's own: its code is imported by the loader before
validation (load.import_own_code). Validation itself imports nothing. See docs/faults.md#recipes-read-back-are-data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

from lorakit.errors import RecipeError
from lorakit.recipe.known_objectives import known_names, objective_code, settings_sections
from lorakit.recipe.load import _apply, _validate, load_yaml
from lorakit.recipe.schema import Recipe

# The recipe's own fields that name Python code to import, (section, key); an objective's section declares
# its own through the registry (known_objectives.objective_code).
CODE_FIELDS = (("train", "objective_module"), ("data", "transform"))
# Trust fields of model: and the flag that grants each.
TRUST_FLAGS = {"trust_remote_code": "--trust-remote-code", "allow_pickle": "--allow-pickle"}


def module_of(spec: str) -> str:
    """The module of a code reference: `pkg.mod` of `pkg.mod:function` (or of `pkg.mod`)."""
    return spec.partition(":")[0].strip()


def allows(allow_code: Collection[str], module: str) -> bool:
    """Whether the caller's --allow-code names `module`, or a package holding it."""
    return any(module == a or module.startswith(a + ".") for a in allow_code)


def named_code(raw: Any) -> dict[str, str]:
    """{dotted field: code reference} of every code field set in the raw recipe mapping."""
    found = {}
    for section, key in CODE_FIELDS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str) and value.strip():
            found[f"{section}.{key}"] = value
    return found | objective_code(raw)


class NotGranted(RecipeError):
    """A recipe read back asks for trust or code its caller did not grant (exit code 2)."""


def _refusal(where: str, field: str, what: str, flag: str) -> NotGranted:
    return NotGranted(
        f"{where}: {field} {what}, and a recipe read back from a run directory or a model card is data: "
        f"it grants nothing; pass {flag} if you trust it"
    )


def read_back_recipe(
    text: str,
    where: str,
    *,
    overrides: Sequence[str] = (),
    trust_remote_code: bool | None = None,
    allow_pickle: bool | None = None,
    allow_code: Collection[str] = (),
    reads_data: bool = False,
    adjust: Callable[[dict], None] | None = None,
) -> Recipe:
    """The Recipe of `text` (read from `where`), with the caller's dotted `overrides`, as data.

    trust_remote_code, allow_pickle: the caller's (None: this command loads no model, and the fields stay
    as the recipe says, for the record). allow_code: the modules the caller lets this recipe import; code
    the command needs (train.objective_module for an objective this process does not know; with
    `reads_data`, data.transform) and the caller did not name is refused (NotGranted, one line).
    adjust: changes the command makes to the raw mapping after the overrides (evaluate's split)."""
    raw = load_yaml(text, where) or {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: the top level must be a mapping of sections (model, data, ...)")
    raw, problems = _apply(raw, overrides)
    if adjust is not None:
        adjust(raw)
    model = raw.get("model")
    for field, flag in TRUST_FLAGS.items():
        granted = {"trust_remote_code": trust_remote_code, "allow_pickle": allow_pickle}[field]
        if granted is None or not isinstance(model, dict):
            continue
        if model.get(field) is True and not granted:
            raise _refusal(where, f"model.{field}", "is true", flag)
        model[field] = granted
    for field, spec in named_code(raw).items():
        module = module_of(spec)
        if allows(allow_code, module):
            if field == "train.objective_module":
                _import(field, module)
            continue  # data.transform: imported where the data is read, as for any recipe
        needed = (
            reads_data  # data.transform, an objective's code (rewards): run where rows are read
            if field != "train.objective_module"
            else raw["train"].get("objective", "sft") not in known_names()
        )
        if needed:
            raise _refusal(where, field, f"names code to import ({spec!r})", f"--allow-code {module}")
    return _validate(raw, problems)


def named_servers(raw: Any) -> dict[str, str]:
    """{dotted field: URL} of the servers the objective sections of a raw recipe mapping (or a Recipe's
    model_dump) would send data to, as their settings models declare them (`named_servers`)."""
    found: dict[str, str] = {}
    for name, model in settings_sections():
        declare = getattr(model, "named_servers", None)
        if declare is not None and isinstance(raw, dict) and isinstance(raw.get(name), dict):
            found |= {f"{name}.{key}": url for key, url in declare(raw[name]).items()}
    return found


def check_servers(raw: Any, where: str, allow_server: Collection[str], given: Collection[str] = ()) -> None:
    """NotGranted (one line) when a recipe read back (a run directory's recipe.yaml being resumed) names a
    server the run would send the adapter and the prompts to (a rollout server) that its caller confirmed
    neither with --allow-server URL (`allow_server`) nor by setting the field on the command line
    (`given`: the dotted fields its overrides set)."""
    for field, url in named_servers(raw).items():
        if field not in given and url not in allow_server:
            raise _refusal(where, field, f"names a server to send the adapter and prompts to ({url!r})",
                           f"--allow-server {url}")  # fmt: skip


def _import(field: str, module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise RecipeError(f"{field} {module!r} cannot be imported: {e}") from None
