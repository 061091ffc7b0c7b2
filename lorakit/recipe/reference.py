"""python -m lorakit.recipe.reference [--write PATH]: the recipe reference (docs/recipes.md), generated
from the schema.

Every key, type, default and description comes from the pydantic models of lorakit.recipe.schema (one module
per section), and the cross-field rules are the messages their validators raise, so the page cannot drift
from the code (a unit test compares docs/recipes.md with this generator's output).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lorakit import storage
from lorakit.recipe.distributed_section import backend_rules
from lorakit.recipe.known_objectives import settings_sections
from lorakit.recipe.schema import Recipe

REGENERATE = "python -m lorakit.recipe.reference --write docs/recipes.md"

_INTRO = f"""\
# Recipe reference

<!-- Generated from the schema (lorakit/recipe/schema.py and its sections) by `{REGENERATE}`; do not edit by hand. -->

A recipe is a YAML file with {{count}} sections, each a mapping of keys:

{{sections}}

Every key has a default except the ones marked **required** below, so a recipe names only what it
changes. Run one, overriding any key with its dotted name on the command line (values are read as YAML,
so `train.lr=2e-4` is a number and `method.target_modules=[q,v]` a list):

    python -m lorakit.run RECIPE section.key=value ...

The schema is strict: an unknown or misspelled key is an error that names it, never silently ignored,
and a validated recipe is frozen. Besides each key's own type and range, the schema's validators reject
combinations of keys that cannot work together; they are listed under each section (and, for checks
that span sections, at the end) with the message they give.
"""


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_type(annotation: Any) -> str:
    """A readable type: `int`, `float`, `bool | "auto"`, `"lora" | "qlora" | "full"`, `list[str]`, ..."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(_literal(v) for v in typing.get_args(annotation))
    if origin is Union or origin is types.UnionType:
        parts = [render_type(a) for a in typing.get_args(annotation)]
        # null last: `str | null` reads as "a string, or nothing".
        return " | ".join([p for p in parts if p != "null"] + [p for p in parts if p == "null"])
    if origin in (list, tuple, set, dict):
        return f"{origin.__name__}[{', '.join(render_type(a) for a in typing.get_args(annotation))}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else render_value(value)


def render_value(value: Any) -> str:
    """A value as it would be written in a recipe (YAML flow style): null, true, 0.0002, [rouge], auto."""
    if isinstance(value, BaseModel):
        # A nested section (distributed.fsdp): its keys and their defaults, each also given its own row.
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def render_default(field: FieldInfo) -> str:
    """`required` for a key without default, else the default as YAML."""
    if field.is_required():
        return "required"
    return render_value(field.get_default(call_default_factory=True))


def render_constraints(field: FieldInfo) -> str:
    """Range constraints (ge/gt/le/lt) as `>= 1`, `>= 0, < 1`; empty when there are none."""
    out = []
    for meta in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(meta, attr, None)
            if isinstance(meta, annotated_types.BaseMetadata) and bound is not None:
                out.append(f"{op} {bound}")
    return ", ".join(out)


def validator_messages(model: type[BaseModel]) -> list[str]:
    """The messages of the ValueErrors raised by the model's own validators, read from their source.

    f-string placeholders are kept as `{name}`, except a trailing `: {e}` that only echoes the cause.
    """
    messages = []
    for name in model.__pydantic_decorators__.model_validators:
        messages += raised_messages(getattr(model, name))
    return messages


def raised_messages(function: Any) -> list[str]:
    """The messages of the ValueErrors `function` raises, read from its source (as validator_messages)."""
    messages = []
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    # `for name in ("a", "b"): ... raise ValueError(f"x.{name} ...")` gives one message per value.
    loops: dict[int, tuple[str, list[str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            values = [e.value for e in getattr(node.iter, "elts", []) if isinstance(e, ast.Constant)]
            if values and len(values) == len(node.iter.elts):
                for inner in ast.walk(node):
                    loops[id(inner)] = (node.target.id, values)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
            continue
        if not (isinstance(node.exc.func, ast.Name) and node.exc.func.id == "ValueError"):
            continue
        var, values = loops.get(id(node), ("", [None]))
        for value in values:
            text = _string(node.exc.args[0], {var: value} if var else {})
            if text is not None:
                messages.append(text)
    return messages


def _string(node: ast.expr, names: dict[str, Any]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = list(node.values)
        if (
            len(parts) >= 2
            and isinstance(parts[-1], ast.FormattedValue)
            and isinstance(parts[-2], ast.Constant)
            and str(parts[-2].value).endswith(": ")
        ):
            parts = parts[:-1]
            parts[-1] = ast.Constant(str(parts[-1].value).removesuffix(": "))
        return "".join(_part(p, names) for p in parts)
    return None


def _part(node: ast.expr, names: dict[str, Any]) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.FormattedValue)
    if isinstance(node.value, ast.Name) and node.value.id in names:
        return str(names[node.value.id])
    return "{" + ast.unparse(node.value) + "}"


def _section_doc(model: type[BaseModel]) -> str:
    return inspect.cleandoc(model.__doc__ or "")


def _rules(messages: list[str]) -> list[str]:
    if not messages:
        return []
    lines = ["", "Also rejected (the validators' messages):", ""]
    lines += [f"- {' '.join(m.split())}" for m in messages]
    return lines


def section_models() -> list[tuple[str, type[BaseModel]]]:
    """The recipe's sections with their models: the declared ones in schema order, then each registered
    objective's (known_objectives: the built-ins, and any plugin registered in this process)."""
    return [(name, field.annotation) for name, field in Recipe.model_fields.items()] + settings_sections()


def _model_in(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The section model a field holds (X, X | null, list[X]) and what its keys' names add: "[]" for a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found[0], "[]" if typing.get_origin(annotation) is list else found[1]
    return None


def _nested(model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """The fields of `model` that hold sections (distributed.fsdp, output.push_to_hub, the entries of a
    data.source list), with their models."""
    return [(key, found[0]) for key, f in model.model_fields.items() if (found := _model_in(f.annotation))]


def _table_rows(prefix: str, model: type[BaseModel]) -> list[str]:
    """One table row per key of `model`, a nested section's keys right after its own row."""
    lines = []
    nested = dict(_nested(model))
    for key, field in model.model_fields.items():
        plain = isinstance(field.annotation, type) and key in nested
        type_text = "section" if plain else render_type(field.annotation)
        constraints = render_constraints(field)
        type_cell = f"`{_cell(type_text)}`" + (f" ({_cell(constraints)})" if constraints else "")
        default = render_default(field)
        default_cell = "**required**" if default == "required" else f"`{_cell(default)}`"
        lines.append(
            f"| `{prefix}.{key}` | {type_cell} | {default_cell} | {_cell(field.description or '')} |"
        )
        if key in nested:
            lines += _table_rows(f"{prefix}.{key}{_model_in(field.annotation)[1]}", nested[key])
    return lines


def generate() -> str:
    """The whole reference page as Markdown."""
    sections = section_models()
    names = ", ".join(f"[`{name}`](#{name})" for name, _ in sections)
    lines = [_INTRO.format(count=_count_word(len(sections)), sections=names).rstrip("\n")]
    for name, model in sections:
        field = Recipe.model_fields.get(name)
        required = "required section" if field is not None and field.is_required() else "optional section"
        lines += ["", f"## {name}", "", f"{_section_doc(model)} ({required})", ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        lines += _table_rows(name, model)
        lines += _rules(
            validator_messages(model) + [m for _, sub in _nested(model) for m in validator_messages(sub)]
        )
    # The sharding backends' own checks (lorakit.backends installs them) are checked on the whole recipe too.
    across = validator_messages(Recipe) + [m for rule in backend_rules() for m in raised_messages(rule)]
    if across:
        lines += [
            "",
            "## Rules across sections",
            "",
            "Checked on the whole recipe, once every section is valid.",
        ]
        lines += _rules(across)
    return "\n".join(lines) + "\n"


def _count_word(n: int) -> str:
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    return words[n] if n < len(words) else str(n)


def write(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically and durably (storage.write_file: temp, fsync, rename, fsync of the
    directory), keeping the page's current mode (a new page: what the umask gives)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_file(path, text, mode=path.stat().st_mode & 0o777 if path.exists() else None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.recipe.reference`."""
    p = argparse.ArgumentParser(prog="python -m lorakit.recipe.reference", description=__doc__)
    p.add_argument("--write", metavar="PATH", help="write the page to PATH (atomically) instead of stdout")
    args = p.parse_args(argv)
    text = generate()
    if args.write:
        write(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
