"""What every recipe section shares: the strict frozen base model and the template placeholder checks."""

from __future__ import annotations

import string

from pydantic import BaseModel, ConfigDict


def placeholders(template: str) -> list[str]:
    """The column names in `template`'s braces, in order of first use; ValueError for anything else in
    braces (an index, an attribute, a format spec) or an unbalanced brace."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{e} (write {{{{ and }}}} for literal braces)") from None
    names: list[str] = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"{{{shown}}}: a placeholder is a column name in braces, like {{premise}} "
                "(write {{ and }} for literal braces)"
            )
        if name not in names:
            names.append(name)
    return names


class Section(BaseModel):
    """A recipe section: unknown keys are errors, values frozen after validation."""

    # extra="forbid": a misspelled key is an error naming it, never silently None. allow_inf_nan=False: no
    # number of a recipe means anything as .inf or .nan (an infinite timeout overflows, an infinite lr
    # diverges at the first step), so either is refused at load, naming the field.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


def check_templates(owner: str, prompt_template: str | None, target_template: str | None) -> None:
    """ValueError naming `owner`.KEY when a template has a bad placeholder or names no column."""
    for name, template in (("prompt_template", prompt_template), ("target_template", target_template)):
        if template is None:
            continue
        try:
            fields = placeholders(template)
        except ValueError as e:
            raise ValueError(f"{owner}.{name} has a bad placeholder: {e}") from None
        if not fields:
            raise ValueError(
                f"{owner}.{name} names no column: put one in braces, e.g. {{input}} or {{premise}}"
            )
