"""Inputs of lorakit.generate: JSON lines of columns, or plain text lines, turned into the prompts the run
was trained on.

A line holding a JSON object is a row of columns, which the run's data section renders: the prompt template
(data.format instruction), data.text_column (completion) or the messages through the tokenizer's chat
template (chat). Any other line is text: the value of the one column the format reads, which is only
possible when it reads one text column (a template with a single placeholder, such as `{input}`; completion;
or no recipe at all, when the text is the prompt as given). A line of a JSON string ("...") is that string,
so a text can hold newlines. Blank lines are skipped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit.data.rows import MESSAGES, SHAREGPT, messages_problem, text_problem
from lorakit.data.templates import prompt_columns, render_prompt
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

INPUTS_DOC = "docs/inference.md#inputs"
# The column a text line fills when there is no recipe.
PLAIN_COLUMN = "input"
# What generate adds to each row; an input column of one of these names would be overwritten.
GENERATED = ("prompt", "output", "label")


@dataclass(frozen=True)
class InputRow:
    """One input: where it came from, its columns (repeated in the output) and its prompt text (None for
    chat rows until the tokenizer renders them)."""

    where: str
    columns: dict[str, Any]
    prompt: str | None


def read_lines(inputs: str | Path | Iterable[Any]) -> Iterator[tuple[str, Any]]:
    """(where, line or value) of each input: lines of a file, of stdin ("-"), or the items of a list (rows
    as dicts, texts as str)."""
    if isinstance(inputs, str | Path):
        name = "stdin" if str(inputs) == "-" else str(inputs)
        if name == "stdin":
            for n, line in enumerate(sys.stdin, 1):
                yield f"stdin line {n}", line
            return
        path = Path(inputs)
        if not path.is_file():
            raise DataError(f"--input {inputs}: no such file", doc=INPUTS_DOC)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield f"{name} line {n}", line
        return
    for n, item in enumerate(inputs):
        yield f"input {n}", item


def parse(where: str, item: Any) -> dict[str, Any] | str | None:
    """A row of columns (a JSON object), a text, or None for a blank line."""
    if isinstance(item, dict):
        return item
    if not isinstance(item, str):
        raise DataError(f"{where}: a {type(item).__name__}, not a row (dict) or a text (str)", doc=INPUTS_DOC)
    text = item.rstrip("\r\n")
    stripped = text.strip()
    if not stripped:
        return None
    if stripped.startswith("{"):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: starts with {{ but is not a JSON object ({e.msg} at column {e.colno}); write one "
                "JSON object per line, or plain text",
                doc=INPUTS_DOC,
            ) from None
    if stripped.startswith('"'):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            return text
        return value if isinstance(value, str) else text
    return text


class Prompter:
    """Renders input rows with a run's data section, or uses them as given when there is none."""

    def __init__(self, data: DataSection | None, writes_label: bool = False):
        self.data = data
        self.reserved = GENERATED if writes_label else GENERATED[:2]

    def columns(self) -> list[str]:
        """The columns a row must have."""
        if self.data is None:
            return [PLAIN_COLUMN]
        if self.data.format == "completion":
            return [self.data.text_column]
        if self.data.format == "chat":
            return [self.data.messages_column]
        return sorted(set(prompt_columns(self.data).values()))

    def describe(self) -> str:
        """What a row needs, for messages."""
        if self.data is None:
            return "no prompt template (no recipe)"
        if self.data.format == "instruction":
            return f"the prompt template {self.data.prompt_template!r}"
        return f"data.format {self.data.format}"

    def row(self, where: str, item: Any) -> InputRow | None:
        """The InputRow of one input, None for a blank line; DataError naming the line when it cannot be
        one."""
        value = parse(where, item)
        if value is None:
            return None
        needed = self.columns()
        if isinstance(value, str):
            chat = self.data is not None and self.data.format == "chat"
            if chat or len(needed) != 1:
                example = json.dumps({c: "..." for c in needed})
                raise DataError(
                    f"{where}: not a JSON object, but {self.describe()} reads the columns {needed}: write each "
                    f"input as one JSON object per line, e.g. {example}",
                    doc=INPUTS_DOC,
                )
            value = {needed[0]: value}
        shown = {}
        if self.data is not None and self.data.format == "chat" and needed == [MESSAGES]:
            # As training reads a source: ShareGPT's `conversations` when the row has no `messages`.
            if MESSAGES not in value and SHAREGPT in value:
                value = {MESSAGES: value[SHAREGPT], **{k: v for k, v in value.items() if k != SHAREGPT}}
                shown[MESSAGES] = SHAREGPT
        for column in needed:
            if column not in value:
                raise DataError(
                    f"{where}: column {column!r} is missing ({self.describe()} reads {needed}); the row has "
                    f"the columns {sorted(value)}",
                    doc=INPUTS_DOC,
                )
            problem = (
                messages_problem if self.data is not None and self.data.format == "chat" else text_problem
            )
            issue = problem(value[column])
            if issue:
                raise DataError(f"{where}: column {shown.get(column, column)!r} {issue}", doc=INPUTS_DOC)
        clash = [c for c in self.reserved if c in value]
        if clash:
            raise DataError(
                f"{where}: column {clash[0]!r} has the name of a field the output adds ({', '.join(self.reserved)}); "
                "rename or drop it",
                doc=INPUTS_DOC,
            )
        return InputRow(where, value, self._text(value))

    def _text(self, row: dict[str, Any]) -> str | None:
        if self.data is None:
            return row[PLAIN_COLUMN]
        if self.data.format == "completion":
            return row[self.data.text_column]
        if self.data.format == "chat":
            return None  # the tokenizer's chat template renders it (lorakit.inference.generation)
        return render_prompt(self.data, row)

    def rows(self, inputs: str | Path | Iterable[Any]) -> list[InputRow]:
        """Every input row, checked; DataError when there is none."""
        rows = [r for where, item in read_lines(inputs) for r in [self.row(where, item)] if r is not None]
        if not rows:
            name = (
                "stdin" if str(inputs) == "-" else inputs if isinstance(inputs, str | Path) else "the inputs"
            )
            raise DataError(f"--input {name}: no input rows (empty, or only blank lines)", doc=INPUTS_DOC)
        return rows
