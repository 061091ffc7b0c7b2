"""Recipe files: YAML in, dotted CLI overrides, one validated Recipe out, and the resolved dump."""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from lorakit.errors import RecipeError
from lorakit.recipe.schema import Recipe
from lorakit.recipe.suggest import unknown_key_message


def _parse_override(item: str) -> tuple[list[str], Any]:
    if len(item) > MAX_BYTES:
        raise RecipeError(f"override {item[:60]!r}...: larger than {MAX_BYTES >> 20} MiB")
    if "=" not in item:
        raise RecipeError(f"override {item!r}: expected KEY=VALUE, e.g. train.lr=2e-4")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {item!r}: the key must be dotted names, e.g. train.lr")
    path = key.split(".")
    if len(path) > MAX_DEPTH:
        raise RecipeError(f"override {key[:60]!r}...: nested more than {MAX_DEPTH} levels deep")
    annotation = _field_annotation(path)
    takes, text = _types_of(annotation), str in _types_of(annotation, literals=False)
    # YAML parsing gives overrides the same types a recipe file would: 2e-4 -> float, [q, v] -> list.
    try:
        value = load_yaml(raw, "<override>") if raw.strip() else None
    except yaml.YAMLError as e:
        if text:  # `data.prompt_template=Summary: {input}` is text, whatever YAML makes of it
            return path, raw.strip()
        raise RecipeError(f"override {item!r}: value is not valid YAML: {e}") from None
    except RecipeError as e:  # nested too deep, too large: named with the override's key
        raise RecipeError(f"override {key}: {e}") from None
    # PyYAML reads 2e-4 (no dot) as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            pass
    # A text field keeps the text as typed: `model.revision=1e5`, `output.dir=2024`, `data.split=yes`
    # would otherwise reach the schema as a number or a boolean and be refused.
    if text and value is not None and not isinstance(value, tuple(takes)):
        value = raw.strip()
    return path, value


def _field_annotation(path: list[str]) -> Any:
    """The type annotation of the recipe field at `path`; None when `path` names no field."""
    model: type[BaseModel] | None = Recipe
    annotation: Any = None
    for part in path:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        annotation = field.annotation
        model = _section_type(annotation)
    return annotation


def _types_of(annotation: Any, literals: bool = True) -> set[type]:
    """The Python types a field of `annotation` accepts (str, int, list, dict, ...); `literals=False`
    leaves out the types of Literal members (`Literal["auto"]` takes no free text)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types_of(typing.get_args(annotation)[0], literals)
    if origin in (Union, types.UnionType):
        return set().union(*(_types_of(a, literals) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(annotation)} if literals else set()
    if origin is not None:
        return {origin}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {dict}
    return {annotation} if isinstance(annotation, type) else set()


def _apply(raw: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `raw` with the well-formed overrides applied, a problem line for each malformed one)."""
    out = _deep_copy(raw)
    problems = []
    for item in overrides:
        try:
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
        except RecipeError as e:
            problems.append(f"  {e}")
    return out, problems


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with dotted `KEY=VALUE` overrides applied; every malformed one is named in
    one RecipeError."""
    out, problems = _apply(raw, overrides)
    if problems:
        raise RecipeError(_report(problems))
    return out


# Aliases may share one node many times over (`b: [*a, *a]`, `c: [*b, *b]`, ...); expanded, a recipe
# larger than this many values is refused before anything copies or validates it.
MAX_EXPANDED_NODES = 100_000
# A recipe nests a few levels (data.mixture: a list of mappings); PyYAML composes and constructs nested
# nodes recursively, so text nested thousands deep would end in a RecursionError and its traceback.
MAX_DEPTH = 64
# The text of a recipe file or one override; shipped recipes are a few KiB.
MAX_BYTES = 1 << 20


class RecipeLoader(yaml.SafeLoader):
    """safe_load's loader (no tags that build objects) that refuses a mapping with a repeated key, naming
    the key and its line: PyYAML would keep the last value silently."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise RecipeError(
                    f"{_source(self.peek_event())}line {mark.line + 1}: nested more than {MAX_DEPTH} levels "
                    "deep; a recipe is refused at that depth"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise RecipeError(
                    f"{_source(key_node)}line {line}: key {key!r} is repeated (first at line {seen[key]}); "
                    "a mapping takes each key once"
                )
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _source(node) -> str:
    """'NAME ' of the file a node or event was read from; '' for text that is no file (an override)."""
    name = node.start_mark.name
    return "" if name.startswith("<") else f"{name} "


def load_yaml(text: str, name: str = "<recipe>") -> Any:
    """Parse recipe YAML: safe tags only, no repeated keys, aliases expanded to at most MAX_EXPANDED_NODES
    values, at most MAX_DEPTH levels and MAX_BYTES of text (RecipeError otherwise, one line)."""
    if len(text) > MAX_BYTES:
        raise RecipeError(f"{name}: larger than {MAX_BYTES >> 20} MiB; a recipe is refused at that size")
    loader = RecipeLoader(text)
    loader.name = name
    try:
        data = loader.get_single_data()
    finally:
        loader.dispose()
    _count_nodes(data, MAX_EXPANDED_NODES, name)
    return data


def _count_nodes(data: Any, budget: int, name: str) -> None:
    stack, count = [data], 0
    while stack:
        item = stack.pop()
        count += 1
        if count > budget:
            raise RecipeError(
                f"{name}: more than {budget} values once its aliases (*name) are expanded; a recipe is "
                "refused at that size (a YAML alias bomb looks like this)"
            )
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def _dotted(loc: tuple) -> str:
    """The dotted recipe field of a pydantic error location. Parts below a leaf field are dropped: they
    name the member of a union (`int`, `literal['auto']`) the value was tried against, not a field."""
    model: type[BaseModel] | None = Recipe
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif model is not None and not part.startswith("function-"):
            parts.append(part)
            field = model.model_fields.get(part)
            model = _section_type(field.annotation) if field is not None else None
    return ".".join(parts)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: its type, or X of an optional section `X | None` (output.push_to_hub)."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
    for option in members or (annotation,):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option if all(m in (option, type(None)) for m in members) else None
    return None


def _validation_lines(err: ValidationError) -> list[str]:
    """One line per field, naming its dotted path; a union's alternatives are joined in that line."""
    by_field: dict[str, list[str]] = {}
    given: dict[str, Any] = {}
    for e in err.errors():
        path = _dotted(e["loc"]) or "recipe"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = unknown_key_message(path, Recipe)
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif not isinstance(e.get("input"), dict):
            given[path] = e.get("input")
        if msg not in by_field.setdefault(path, []):
            by_field[path].append(msg)
    lines = []
    for path, msgs in by_field.items():
        prefix = "Input should be "
        if len(msgs) > 1 and all(m.startswith(prefix) for m in msgs):
            # "a valid integer, unable to parse string as an integer" + "'auto'" -> "a valid integer or 'auto'"
            msgs = [prefix + " or ".join(m.removeprefix(prefix).split(", unable to")[0] for m in msgs)]
        text = "; or ".join(msgs)
        if path in given:
            text += f" (got {given[path]!r:.60})"
        # A cross-field check names its fields itself ("data.prompt_template must ...").
        lines.append(f"  {text}" if text.startswith(f"{path}.") else f"  {path}: {text}")
    return lines


def _report(lines: list[str]) -> str:
    count = f"{len(lines)} problems" if len(lines) > 1 else "1 problem"
    return f"invalid recipe ({count}):\n" + "\n".join(lines)


def _validate(raw: Any, problems: Sequence[str] = ()) -> Recipe:
    """A frozen Recipe, or one RecipeError listing `problems` and every schema error with its field."""
    if not isinstance(raw, dict):
        raise RecipeError("invalid recipe: the top level must be a mapping of sections (model, data, ...)")
    lines = list(problems)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        lines += _validation_lines(e)
    if lines:
        raise RecipeError(_report(lines))
    return recipe


def import_own_code(raw: Any) -> list[str]:
    """Import train.objective_module of a recipe the caller gave (a file on its command line, its own dict),
    which registers a plugin objective, before the recipe is validated: validation imports nothing, and a
    recipe read back from a run directory imports only what its caller allows (recipe/read_back.py).
    Returns a problem line when the module cannot be imported."""
    from lorakit.recipe.known_objectives import import_objective_module

    train = raw.get("train") if isinstance(raw, dict) else None
    module = train.get("objective_module") if isinstance(train, dict) else None
    if not isinstance(module, str):
        return []  # absent, or of a type validation reports
    try:
        import_objective_module(module)
    except ValueError as e:
        return [f"  {e}"]
    return []


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Validate the caller's own plain dict into a frozen Recipe (importing its train.objective_module
    first), raising RecipeError with field names. A recipe read back from a run directory or a model card
    goes through recipe.read_back.read_back_recipe instead."""
    return _validate(raw, import_own_code(raw))


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML file, apply dotted overrides (`train.lr=2e-4`), and validate it."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        # A safe loader: a recipe is data; tags such as !!python/object, which build objects, are refused.
        raw = load_yaml(path.read_text(), str(path)) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    # Malformed overrides and schema errors are reported together, so one run shows every mistake.
    raw, problems = _apply(raw, overrides)
    # The file named on the caller's command line (or by its Python code) is the caller's own recipe.
    return _validate(raw, problems + import_own_code(raw))


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
