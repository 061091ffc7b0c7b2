"""Prompt and target templates: `{name}` placeholders filled from the columns of a row.

(What a placeholder may be is the schema's rule: lorakit.recipe.schema.placeholders.)

`data.prompt_template` (and `data.target_template`) may name any columns of the dataset: `{premise}` reads
column `premise`. Two names are aliases kept for the one-column case: `{input}` reads `data.input_column`
and, in the target template, `{target}` reads `data.target_column`. Without a target template the target
is `data.target_column` itself (a label word when the column holds class ids: lorakit.data.sources).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorakit.recipe.schema import DataSection, placeholders


def prompt_columns(data: DataSection) -> dict[str, str]:
    """{placeholder: column} of data.prompt_template (`{input}` reads data.input_column)."""
    return {p: data.input_column if p == "input" else p for p in placeholders(data.prompt_template)}


def target_columns(data: DataSection) -> dict[str, str]:
    """{placeholder: column} of the target: data.target_template's (`{target}` reads data.target_column),
    or data.target_column alone."""
    if data.target_template is None:
        return {"target": data.target_column}
    return {p: data.target_column if p == "target" else p for p in placeholders(data.target_template)}


def fill(template: str, columns: Mapping[str, str], row: Mapping[str, Any]) -> str:
    """`template` with each placeholder replaced by its column's value in `row`."""
    return template.format(**{p: row[c] for p, c in columns.items()})


def render_prompt(data: DataSection, row: Mapping[str, Any]) -> str:
    """The model input of `row` (a mapping of column -> text)."""
    return fill(data.prompt_template, prompt_columns(data), row)


def render_target(data: DataSection, row: Mapping[str, Any]) -> str:
    """The text the model must produce for `row`."""
    if data.target_template is None:
        return row[data.target_column]
    return fill(data.target_template, target_columns(data), row)


def rows_of(batch: Mapping[str, list]) -> list[dict[str, Any]]:
    """A `datasets` batch (column -> values) as a list of rows (column -> value)."""
    columns = list(batch)
    n = len(batch[columns[0]]) if columns else 0
    return [{c: batch[c][i] for c in columns} for i in range(n)]


def fit_prompt(data: DataSection, row: Mapping[str, Any], tokenizer, budget: int) -> str:
    """The prompt of `row` with its fields cut to `budget` tokens in all, so the template's own text (an
    instruction, "Summary:") survives truncation. Short fields stay whole; the budget left is shared equally
    among the longer ones, so the longest field is cut the most (one field: its first `budget` tokens)."""
    columns = prompt_columns(data)
    ids = {
        p: tokenizer(str(row[c]), add_special_tokens=False, verbose=False)["input_ids"]
        for p, c in columns.items()
    }
    share, left = dict.fromkeys(ids, 0), budget
    for k, p in enumerate(sorted(ids, key=lambda p: len(ids[p]))):
        share[p] = min(len(ids[p]), left // (len(ids) - k))
        left -= share[p]
    values = {p: tokenizer.decode(ids[p][: share[p]], skip_special_tokens=True) for p in ids}
    return data.prompt_template.format(**values)
