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
    """The prompt of `row` with its fields cut to `budget` tokens in all (fit_prompts for one row)."""
    return fit_prompts(data, [row], tokenizer, budget)[0]


# Characters of a field tokenized per token of the budget at first (doubled until enough), unless the caller
# knows the text's own ratio: a field is cut to at most `budget` tokens, so its whole text (maybe thousands
# of tokens) is never tokenized again.
_CHARS_PER_TOKEN = 8
# Tokens past the budget a character prefix must yield: the last tokens of a prefix may differ from the
# whole text's (a word cut in two), the ones well before it do not.
_MARGIN = 8


def _field_heads(
    tokenizer, texts: list[str], budget: int, ratios: list[float] | None
) -> list[tuple[list[int], bool]]:
    """(the first tokens of each text, at least budget + _MARGIN of them when it has that many; whether
    that is the whole text's tokens), tokenizing character prefixes in batches: of budget x the text's
    characters per token (`ratios`, a quarter more) or x _CHARS_PER_TOKEN, doubled until enough."""
    out: list[tuple[list[int], bool] | None] = [None] * len(texts)
    want = budget + _MARGIN
    chars = [int(want * 1.25 * r) + 16 if ratios else want * _CHARS_PER_TOKEN for r in ratios or texts]
    todo = list(range(len(texts)))
    while todo:
        heads = tokenizer([texts[i][: chars[i]] for i in todo], add_special_tokens=False, verbose=False)
        again = []
        for i, ids in zip(todo, heads["input_ids"], strict=True):
            whole = len(texts[i]) <= chars[i]
            if whole or len(ids) > want:
                out[i] = (ids if whole else ids[: budget + 1], whole)
            else:
                again.append(i)
                chars[i] *= 2
        todo = again
    return out  # type: ignore[return-value]


def decode_many(tokenizer, ids: list[list[int]]) -> list[str]:
    """batch_decode without special tokens; a fast tokenizer's backend directly where transformers would
    add nothing (its per-token Python checks cost more than the decoding)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch(ids, skip_special_tokens=True)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def fit_prompts(
    data: DataSection,
    rows: list[Mapping[str, Any]],
    tokenizer,
    budget: int,
    ratios: list[float] | None = None,
) -> list[str]:
    """The prompt of each row with its fields cut to `budget` tokens in all, so the template's own text (an
    instruction, "Summary:") survives truncation. Short fields stay whole; the budget left is shared equally
    among the longer ones, so the longest field is cut the most (one field: its first `budget` tokens).
    `ratios`: each row's characters per token, when known (one per row; a speed hint only)."""
    columns = prompt_columns(data)
    names = list(columns)
    texts = [str(row[columns[p]]) for row in rows for p in names]
    per_field = [r for r in ratios for _ in names] if ratios else None
    heads = iter(_field_heads(tokenizer, texts, budget, per_field))
    cut: list[list[int]] = []
    for _ in rows:
        ids = {p: next(heads)[0] for p in names}  # a cut head is longer than the budget: "long" as the whole
        share, left = dict.fromkeys(ids, 0), budget
        for k, p in enumerate(sorted(ids, key=lambda p: len(ids[p]))):
            share[p] = min(len(ids[p]), left // (len(ids) - k))
            left -= share[p]
        cut += [ids[p][: share[p]] for p in names]
    values = iter(decode_many(tokenizer, cut))
    return [data.prompt_template.format(**{p: next(values) for p in names}) for _ in rows]
