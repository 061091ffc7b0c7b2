"""What a usable row is: the columns a recipe reads, the checks each row gets as it is read (text fields,
chat messages, label words), data.on_bad_rows applied to the bad ones (RowCollector), and the checked rows of a
split with where each came from (SourceRows, RowLocator). lorakit.data.sources reads the files and hub splits.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np

from lorakit.data.chat import normalize_messages
from lorakit.data.templates import prompt_columns, target_columns
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# Bad rows quoted by name in the terminal and in summary.json; the rest are only counted.
MAX_QUOTED = 5
# Where the documentation explains the errors of this step (printed after them by the CLIs).
BAD_ROWS_DOC = "docs/data.md#bad-rows-dataon_bad_rows"
COLUMNS_DOC = "docs/data.md#formats-and-the-columns-they-read"


def required_columns(data: DataSection) -> dict[str, str]:
    """{recipe field: column name} of the columns the recipe's data.format reads (instruction: every column
    the prompt and target templates name)."""
    if data.format == "completion":
        return {"data.text_column": data.text_column}
    if data.format == "chat":
        return {"data.messages_column": data.messages_column}
    if data.format == "alpaca":
        return {"data.format alpaca": "instruction", "data.format alpaca ": "output"}
    fields: dict[str, str] = {}  # column -> the field that names it first
    for p, column in prompt_columns(data).items():
        fields.setdefault(column, "data.input_column" if p == "input" else f"data.prompt_template {{{p}}}")
    for p, column in target_columns(data).items():
        fields.setdefault(column, "data.target_column" if p == "target" else f"data.target_template {{{p}}}")
    return {field: column for column, field in fields.items()}


# Alpaca rows become one prompt and one target column (lorakit.data.mixture uses the same names).
ALPACA_PROMPT, ALPACA_TARGET = "__prompt", "__target"
# data.messages_column's default, and the column read instead when a source has none (ShareGPT's).
MESSAGES, SHAREGPT = "messages", "conversations"
_ALPACA = (
    "Below is an instruction that describes a task{}. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{}\n\n{}### Response:\n"
)


def alpaca_prompt(row: dict) -> str:
    """The standard Alpaca prompt of a row: with its `input` when it has a non-empty one, else without."""
    given = row.get("input")
    if isinstance(given, str) and given.strip():
        context = ", paired with an input that provides further context"
        return _ALPACA.format(context, row["instruction"], f"### Input:\n{given}\n\n")
    return _ALPACA.format("", row["instruction"], "")


def label_columns(data: DataSection) -> set[str]:
    """The columns whose class ids (integers) become label words: the target's."""
    return set(target_columns(data).values()) if data.format == "instruction" else set()


@dataclass(frozen=True)
class RowLocator:
    """Names where row i of a loaded split came from: `data/train.jsonl line 182`, or `... row 181`.

    Small and picklable, so tokenizing functions (datasets.map, maybe in worker processes) can carry it."""

    origin: str
    # "line": 1-based line of a text file; "row": 0-based index in a parquet file, JSON array or hub split.
    unit: str
    # positions[i] is where row i is, in units; None when row i is simply at i.
    positions: np.ndarray | None = None
    # A split read from several files: "FILE UNIT" of each, and the file of every row.
    files: tuple[str, ...] | None = None
    file_of: np.ndarray | None = None

    def __call__(self, i: int) -> str:
        position = int(self.positions[i]) if self.positions is not None else i
        if self.files is not None and self.file_of is not None:
            return f"{self.files[int(self.file_of[i])]} {position}"
        return f"{self.origin} {self.unit} {position}"

    def take(self, indices: np.ndarray) -> RowLocator:
        """The locator of the rows at `indices` (in that order)."""
        positions = self.positions[indices] if self.positions is not None else np.asarray(indices)
        file_of = self.file_of[indices] if self.file_of is not None else None
        return RowLocator(self.origin, self.unit, positions, self.files, file_of)


@dataclass
class SourceRows:
    """The usable rows of one split (only the columns data.format reads), where each came from, and the
    bad rows that data.on_bad_rows skip left out."""

    rows: datasets.Dataset
    where: RowLocator
    skipped: int = 0
    # "ORIGIN line N: reason" of the first MAX_QUOTED rows left out.
    quoted: list[str] = field(default_factory=list)
    # The label words of a classification target (class ids became these), else None.
    labels: list[str] | None = None

    def keeping(self, kept: list[int], refused: list[str]) -> SourceRows:
        """These rows with only the indices `kept`, the `refused` ones ("where: reason" each, as a chat
        template refused them) counted and quoted as skipped."""
        if not refused:
            return self
        where = self.where.take(np.asarray(kept, dtype=np.int64))
        quoted = (self.quoted + refused)[:MAX_QUOTED]
        return SourceRows(self.rows.select(kept), where, self.skipped + len(refused), quoted, self.labels)


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def text_problem(value: Any) -> str | None:
    """Why `value` cannot be a text field (null, not a string, empty), or None when it can."""
    if value is None:
        return "is null"
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not text: {value!r:.60}"
    if not value.strip():
        return "is empty"
    return None


def flag_problem(value: Any) -> str | None:
    """Why `value` cannot be a yes/no label (true/false, or 1/0), or None when it can."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return None
    return f"is {_json_type(value)} {value!r:.60}, not a label (true/false or 1/0)"


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a conversation lorakit reads (normalize_messages, default layouts), or None."""
    return normalize_messages(messages, None, {})[1]


def load_transform(spec: str | None) -> Callable[[dict], dict | None] | None:
    """The function data.transform names (`package.module:function`), imported; DataError when it is not."""
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise DataError(f"data.transform: cannot import {spec!r}: {e}") from e
    if not callable(fn):
        raise DataError(f"data.transform: {spec!r} is not a function")
    return fn


def transform_source(spec: str | None) -> str | None:
    """The source text of data.transform's function (its module's, when that cannot be read): part of the
    token cache key, so editing the function prepares the data again."""
    fn = load_transform(spec)
    if fn is None:
        return None
    try:
        return inspect.getsource(inspect.getmodule(fn) or fn)
    except (OSError, TypeError):
        return spec


class _BadLabel(str):
    """Why a target value is not a usable label (a str, so it reads as the reason)."""


class RowCollector:
    """Checks rows as they are read and keeps the good ones, applying data.on_bad_rows to the others."""

    def __init__(
        self,
        data: DataSection,
        origin: str,
        unit: str,
        limit: int | None,
        labels: list[str] | None = None,
        columns: dict[str, str] | None = None,
        flags: frozenset[str] = frozenset(),
        aliases: dict[str, str] | None = None,
    ):
        # {field: column}; `columns` replaces what data.format reads (preference pairs: data/pairs.py).
        self.columns = columns if columns is not None else required_columns(data)
        self.chat = data.messages_column if data.format == "chat" and columns is None else None
        # {column: the column read instead when a source has none}: by default ShareGPT's conversations
        # for chat examples; a row layout may name others (TRL's `prompt` for preference pairs).
        default = {MESSAGES: SHAREGPT} if self.chat == MESSAGES else {}
        self.aliases = aliases if aliases is not None else default
        # Columns of those holding a yes/no label (true/false or 1/0: KTO's, data/unpaired.py), not text.
        self.flags = flags
        # Preference (and KTO) rows in chat form: the prompt and each response are text or a list of messages.
        chat_form = data.format == "chat" and columns is not None
        self.loose = set(self.columns.values()) - flags if chat_form else set()
        self.alpaca = data.format == "alpaca" and columns is None
        self.message_keys, self.roles = data.message_keys, data.roles or {}
        # {column: the alias the source has} for each column read under another name (ShareGPT's
        # `conversations` as `messages`, TRL's `prompt`): a bad row is named by the column the user has.
        self.read_from: dict[str, str] = {}
        self.transform = load_transform(data.transform)
        # Class ids in these columns become labels[id]; with labels known, a text target must be one of them.
        self.label_columns, self.labels = (label_columns(data) if columns is None else set()), labels
        self.direct_label = data.target_template is None
        self.policy, self.origin, self.unit, self.limit = data.on_bad_rows, origin, unit, limit
        stored = (ALPACA_PROMPT, ALPACA_TARGET) if self.alpaca else self.columns.values()
        self.values: dict[str, list] = {c: [] for c in stored}
        self.positions: list[int] = []
        # Several files of one split (data.data_files, sharded parquet): "FILE UNIT" of each, file of each row.
        self.files: list[str] = []
        self.file_of: list[int] = []
        self.skipped = 0
        self.quoted: list[str] = []
        # Keys seen in any row: a column no row has is a wrong column name (a recipe mistake), not bad rows.
        self.seen: set[str] = set()
        # Under policy error, the first row missing a column not seen yet: raised once some row has that
        # column (the row is bad), or reported as a wrong column name if none has.
        self.pending: tuple[str, str] | None = None

    def next_file(self, origin: str, unit: str) -> None:
        """Rows from here on come from another file of the same split."""
        self.origin, self.unit = origin, unit
        self.files.append(f"{origin} {unit}")

    def set_unit(self, unit: str) -> None:
        """The current file's rows are named in `unit` after all (a .json file of JSON lines)."""
        self.unit = unit
        if self.files:
            self.files[-1] = f"{self.origin} {unit}"

    def full(self) -> bool:
        return self.limit is not None and len(self.positions) >= self.limit

    def problem(self, row: dict) -> tuple[str, str | None] | None:
        """(reason, the missing column or None) of a bad row; None for a good one. Class ids in the target
        are replaced by their label words in `row`; messages are stored normalized, as JSON text."""
        for column, other in self.aliases.items():
            if column not in row and other in row:
                row[column] = row.pop(other)
                self.read_from[column] = other
        for column in self.columns.values():
            if column not in row:
                return f"column {column!r} is missing", column
            value = row[column]
            if column in self.label_columns:
                value = row[column] = self._label(value)
                if isinstance(value, _BadLabel):
                    return f"column {column!r} {value}", None
            if column == self.chat or (column in self.loose and not isinstance(value, str)):
                messages, issue = normalize_messages(value, self.message_keys, self.roles)
                row[column] = json.dumps(messages, ensure_ascii=False) if issue is None else None
            elif column in self.loose:
                issue = text_problem(value)
                row[column] = json.dumps(value, ensure_ascii=False)
            else:
                issue = text_problem(value)
            if column in self.flags:
                issue = flag_problem(value)
                row[column] = bool(value)  # 1/0 and true/false alike (one Arrow type)
            if issue:
                shown = self.read_from.get(column, column)
                return f"column {shown!r} {issue}", None
        if self.alpaca:
            given = row.get("input")
            if given is not None and not isinstance(given, str):
                return f"column 'input' {text_problem(given)}", None
            row[ALPACA_PROMPT], row[ALPACA_TARGET] = alpaca_prompt(row), row["output"]
        return None

    def _label(self, value: Any) -> Any:
        """A class id as its label word; a text label checked against the known labels."""
        if isinstance(value, int) and not isinstance(value, bool):
            if self.labels is None:
                return _BadLabel(
                    f"is the class id {value}, not text; give data.label_names to turn class ids into words"
                )
            if not 0 <= value < len(self.labels):
                last = len(self.labels) - 1
                return _BadLabel(f"is the class id {value}, outside 0..{last} (the labels are {self.labels})")
            return self.labels[value]
        if self.labels is not None and self.direct_label and isinstance(value, str) and value.strip():
            if value not in self.labels:
                return _BadLabel(f"is {value!r}, not one of the labels {self.labels}")
        return value

    def add(self, position: int, row: Any = None, reason: str | None = None) -> None:
        """Take the row at `position`, or note that it could not be read (`reason`)."""
        missing = None
        if reason is None and not isinstance(row, dict):
            reason = f"a JSON {_json_type(row)}, not an object of columns"
        if reason is None and self.transform is not None:
            row, reason = self._transformed(row)
            if row is None and reason is None:
                return
        if reason is None:
            self.seen.update(row)
            if self.pending is not None and self.pending[1] in self.seen:
                self._stop(self.pending[0])
            bad = self.problem(row)
            if bad is None:
                for column, values in self.values.items():
                    values.append(row[column])
                self.positions.append(position)
                if self.files:
                    self.file_of.append(len(self.files) - 1)
                return
            reason, missing = bad
        where = f"{self.origin} {self.unit} {position}: {reason}"
        if self.policy == "error":
            if missing is None or missing in self.seen:
                self._stop(where)
            if self.pending is None:
                self.pending = (where, missing)
            return
        self.skipped += 1
        if len(self.quoted) < MAX_QUOTED:
            self.quoted.append(where)

    def _transformed(self, row: dict) -> tuple[dict | None, str | None]:
        """(row, None) after data.transform, (None, None) when it leaves the row out, (None, why) when it
        fails on the row (a bad row)."""
        try:
            out = self.transform(dict(row))
        except Exception as e:  # the user's code: any failure on one row is that row's problem
            return None, f"data.transform failed: {type(e).__name__}: {e}"
        if out is not None and not isinstance(out, dict):
            return None, f"data.transform returned {type(out).__name__}, not a row (a dict) or None"
        return out, None

    def _stop(self, where: str) -> None:
        raise DataError(
            f"data.on_bad_rows is error: {where}. Fix or remove that row, or set data.on_bad_rows: skip to "
            "leave such rows out (they are counted in summary.json)",
            doc=BAD_ROWS_DOC,
        )

    def check_columns(self, available: Iterable[str]) -> None:
        """DataError naming the recipe field of the first required column not in `available`."""
        available = list(available)
        available += [column for column, other in self.aliases.items() if other in available]
        for name, column in self.columns.items():
            if column not in available:
                raise DataError(
                    f"{name}: column {column!r} not found in {self.origin}; available columns: {available}",
                    doc=COLUMNS_DOC,
                )

    def finish(self) -> None:
        """Raise what only the whole split can show: a column no row has, or no usable row at all."""
        if self.seen:
            self.check_columns(sorted(self.seen))
        if self.pending is not None:
            self._stop(self.pending[0])
        if not self.positions:
            if self.skipped:
                raise DataError(
                    f"data.on_bad_rows is skip, but all {self.skipped} rows of {self.origin} are bad, e.g. "
                    + "; ".join(self.quoted[:2]),
                    doc=BAD_ROWS_DOC,
                )
            raise DataError(f"data.source: {self.origin} has no rows")

    def dataset(self) -> SourceRows:
        """The kept rows as an in-memory Dataset, with their lines (or indices) and the skip count."""
        self.finish()
        import pyarrow as pa

        types = {c: pa.bool_() if c in self.flags else pa.string() for c in self.values}
        try:
            # Straight to Arrow: Dataset.from_dict scans every value for mixed struct types first.
            ds = datasets.Dataset(pa.table({c: pa.array(v, type=types[c]) for c, v in self.values.items()}))
        except (TypeError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
            raise DataError(f"{self.origin}: the rows cannot be stored as one table: {e}") from e
        positions = np.asarray(self.positions, dtype=np.int64)
        if len(self.files) > 1:
            origin = f"{self.files[0].rsplit(' ', 1)[0]} and {len(self.files) - 1} more file(s)"
            file_of = np.asarray(self.file_of, dtype=np.int64)
            where = RowLocator(origin, self.unit, positions, tuple(self.files), file_of)
        else:
            where = RowLocator(self.origin, self.unit, positions)
        return SourceRows(ds, where, self.skipped, self.quoted, self.labels)
