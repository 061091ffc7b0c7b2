"""Where rows come from (a hub dataset id, a local file or directory, or a dataset shipped with lorakit),
and which of them can be used.

Local .jsonl, .json and .csv files are read here rather than by `datasets`, for two reasons: its JSON
loader rejects a whole file for one malformed line, without saying which; and a row read here keeps its
line number, so every later complaint about it (a bad field, an over-long example, a chat template that
fails on it) names the file and line. Parquet files and hub datasets are read with pyarrow / `datasets`
and their rows are named by index. Every row is checked before tokenizing; `data.on_bad_rows` decides
whether a bad one stops the run (error) or is left out and counted (skip).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from lorakit.data.templates import prompt_columns, target_columns
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# The column that names each example's source in a dataset mixture (lorakit.data.mixture); tokenizing keeps it.
SOURCE = "source"
# Suffixes a local source may have, in the order a directory is searched for {split}{suffix}.
_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
# Bad rows quoted by name in the terminal and in summary.json; the rest are only counted.
MAX_QUOTED = 5
# Where the documentation explains the errors of this step (printed after them by the CLIs).
BAD_ROWS_DOC = "docs/data.md#bad-rows-dataon_bad_rows"
COLUMNS_DOC = "docs/data.md#formats-and-the-columns-they-read"
OVERLONG_DOC = "docs/data.md#over-long-examples-dataoverlong"


def required_columns(data: DataSection) -> dict[str, str]:
    """{recipe field: column name} of the columns the recipe's data.format reads (instruction: every column
    the prompt and target templates name)."""
    if data.format == "completion":
        return {"data.text_column": data.text_column}
    if data.format == "chat":
        return {"data.messages_column": data.messages_column}
    fields: dict[str, str] = {}  # column -> the field that names it first
    for p, column in prompt_columns(data).items():
        fields.setdefault(column, "data.input_column" if p == "input" else f"data.prompt_template {{{p}}}")
    for p, column in target_columns(data).items():
        fields.setdefault(column, "data.target_column" if p == "target" else f"data.target_template {{{p}}}")
    return {field: column for column, field in fields.items()}


def label_columns(data: DataSection) -> set[str]:
    """The columns whose class ids (integers) become label words: the target's."""
    return set(target_columns(data).values()) if data.format == "instruction" else set()


def table_label_names(data: DataSection, features: datasets.Features | None) -> list[str] | None:
    """The label words of a split: data.label_names, else the ClassLabel names of its target column."""
    target = features.get(data.target_column) if features is not None else None
    names = list(target.names) if isinstance(target, datasets.ClassLabel) else None
    if data.label_names is None or names is None:
        return data.label_names or names
    if len(names) != len(data.label_names):
        raise DataError(
            f"data.label_names has {len(data.label_names)} words but column {data.target_column!r} has "
            f"{len(names)} classes {names}; give one word per class, in class-id order",
            doc=COLUMNS_DOC,
        )
    return list(data.label_names)


def resolve_local_source(source: str) -> Path | None:
    """The local path behind `source` (a file, a directory or `builtin:NAME`), or None for a hub id."""
    if source.startswith("builtin:"):
        from lorakit.data.samples import builtin_dataset_dir

        return builtin_dataset_dir(source.removeprefix("builtin:"))
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if source.startswith((".", "/", "~")) or Path(source).suffix in _SUFFIXES:
        raise DataError(f"data.source: no such file or directory: {source}")
    return None


def _local_split_file(path: Path, split: str) -> Path:
    """The file holding one split of a local file or directory source."""
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise DataError(f"data.source: unsupported file type {path.suffix!r}; use {sorted(_SUFFIXES)}")
        if split != "train":
            raise DataError(
                f"data.source is a single file, which holds only the 'train' split; split {split!r} needs "
                "a directory with one {split}.jsonl (or .json/.csv/.parquet) file per split"
            )
        return path
    for suffix in _SUFFIXES:
        candidate = path / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    raise DataError(
        f"data.source: directory {path} has no {split}.jsonl/.json/.csv/.parquet for split {split!r}"
    )


def source_fingerprint(data: DataSection, split: str) -> str:
    """A string that changes when the rows of this split can change (file contents or hub revision)."""
    local = resolve_local_source(data.source)
    if local is None:
        return f"hub:{data.source}:{data.config}:{split}"
    file = _local_split_file(local, split)
    stat = file.stat()
    return f"file:{file}:{stat.st_size}:{stat.st_mtime_ns}"


@dataclass(frozen=True)
class RowLocator:
    """Names where row i of a loaded split came from: `data/train.jsonl line 182`, or `... row 181`.

    Small and picklable, so tokenizing functions (datasets.map, maybe in worker processes) can carry it."""

    origin: str
    # "line": 1-based line of a text file; "row": 0-based index in a parquet file, JSON array or hub split.
    unit: str
    # positions[i] is where row i is, in units; None when row i is simply at i.
    positions: np.ndarray | None = None

    def __call__(self, i: int) -> str:
        position = int(self.positions[i]) if self.positions is not None else i
        return f"{self.origin} {self.unit} {position}"


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


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a non-empty list of {role, content} texts, or None when it is."""
    if not isinstance(messages, list) or not messages:
        return f"must be a non-empty list of {{role, content}} messages, got {type(messages).__name__}: {messages!r:.60}"
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {j} is {type(m).__name__}, not a {{role, content}} mapping"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return (
                f"message {j} needs a text 'role', got {type(m.get('role')).__name__}: {m.get('role')!r:.60}"
            )
        if not isinstance(m.get("content"), str):
            return f"message {j} needs a text 'content', got {type(m.get('content')).__name__}: {m.get('content')!r:.60}"
    return None


class _BadLabel(str):
    """Why a target value is not a usable label (a str, so it reads as the reason)."""


class _Collector:
    """Checks rows as they are read and keeps the good ones, applying data.on_bad_rows to the others."""

    def __init__(
        self, data: DataSection, origin: str, unit: str, limit: int | None, labels: list[str] | None = None
    ):
        self.columns = required_columns(data)  # {field: column}
        self.chat = data.messages_column if data.format == "chat" else None
        # Class ids in these columns become labels[id]; with labels known, a text target must be one of them.
        self.label_columns, self.labels = label_columns(data), labels
        self.direct_label = data.target_template is None
        self.policy, self.origin, self.unit, self.limit = data.on_bad_rows, origin, unit, limit
        self.values: dict[str, list] = {c: [] for c in self.columns.values()}
        self.positions: list[int] = []
        self.skipped = 0
        self.quoted: list[str] = []
        # Keys seen in any row: a column no row has is a wrong column name (a recipe mistake), not bad rows.
        self.seen: set[str] = set()
        # Under policy error, the first row missing a column not seen yet: raised once some row has that
        # column (the row is bad), or reported as a wrong column name if none has.
        self.pending: tuple[str, str] | None = None

    def full(self) -> bool:
        return self.limit is not None and len(self.positions) >= self.limit

    def problem(self, row: dict) -> tuple[str, str | None] | None:
        """(reason, the missing column or None) of a bad row; None for a good one. Class ids in the target
        are replaced by their label words in `row`."""
        for column in self.values:
            if column not in row:
                return f"column {column!r} is missing", column
            value = row[column]
            if column in self.label_columns:
                value = row[column] = self._label(value)
                if isinstance(value, _BadLabel):
                    return f"column {column!r} {value}", None
            issue = messages_problem(value) if column == self.chat else text_problem(value)
            if issue:
                return f"column {column!r} {issue}", None
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
        if reason is None:
            self.seen.update(row)
            if self.pending is not None and self.pending[1] in self.seen:
                self._stop(self.pending[0])
            bad = self.problem(row)
            if bad is None:
                for column, values in self.values.items():
                    values.append(row[column])
                self.positions.append(position)
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

    def _stop(self, where: str) -> None:
        raise DataError(
            f"data.on_bad_rows is error: {where}. Fix or remove that row, or set data.on_bad_rows: skip to "
            "leave such rows out (they are counted in summary.json)",
            doc=BAD_ROWS_DOC,
        )

    def check_columns(self, available: Iterable[str]) -> None:
        """DataError naming the recipe field of the first required column not in `available`."""
        available = list(available)
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
        features = {c: datasets.Value("string") for c in self.values if c != self.chat}
        try:
            if self.chat is None:
                ds = datasets.Dataset.from_dict(self.values, features=datasets.Features(features))
            else:
                ds = datasets.Dataset.from_dict(self.values)
        except (TypeError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
            raise DataError(f"{self.origin}: the rows cannot be stored as one table: {e}") from e
        where = RowLocator(self.origin, self.unit, np.asarray(self.positions, dtype=np.int64))
        return SourceRows(ds, where, self.skipped, self.quoted, self.labels)


def _read_json_lines(path: Path, rows: _Collector) -> None:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                # rstrip: a reason "at column N" must point into this line, not past its newline.
                row, reason = json.loads(raw.rstrip()), None
            except json.JSONDecodeError as e:
                row, reason = None, f"invalid JSON ({e.msg} at column {e.colno})"
            except UnicodeDecodeError:
                row, reason = None, "not UTF-8 text"
            rows.add(lineno, row, reason)
            if rows.full():
                return


def _read_json(path: Path, rows: _Collector) -> None:
    """A .json file: one JSON array of row objects, or JSON lines (what `datasets` also accepts)."""
    text = path.read_bytes()
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        if text.lstrip()[:1] == b"[":
            detail = (
                f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
            )
            raise DataError(f"data.source: {rows.origin} is not valid JSON ({detail})") from None
        doc = None
    if isinstance(doc, dict):  # one object: a file of one row, however it is laid out
        rows.unit = "line"
        rows.add(1, doc)
        return
    if not isinstance(doc, list):
        rows.unit = "line"
        _read_json_lines(path, rows)
        return
    for i, row in enumerate(doc):
        rows.add(i, row)
        if rows.full():
            return


def _read_csv(path: Path, rows: _Collector) -> None:
    """A .csv file with a header line; every value is text (no type guessing: `007` stays `007`)."""
    # The csv module refuses fields over 128 KiB by default; a long document is a legitimate field. Only
    # ever raised, never lowered, so other users of the module keep at least the limit they had.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            rows.check_columns(reader.fieldnames or [])
            rows.seen.update(reader.fieldnames or [])
            for row in reader:
                # A short row fills its missing fields with None: those columns are missing from it.
                rows.add(reader.line_num, {k: v for k, v in row.items() if v is not None})
                if rows.full():
                    return
        except UnicodeDecodeError:
            raise DataError(
                f"data.source: {rows.origin} is not UTF-8 text after line {reader.line_num}"
            ) from None
        except csv.Error as e:
            raise DataError(
                f"data.source: {rows.origin} line {reader.line_num}: not valid CSV: {e}"
            ) from None


def _iter_table(ds: datasets.Dataset, columns: list[str]) -> Iterator[tuple[int, dict]]:
    batch_size = 1000
    table = ds.select_columns(columns)
    for start in range(0, len(ds), batch_size):
        batch = table[start : start + batch_size]
        for k in range(len(batch[columns[0]])):
            yield start + k, {c: batch[c][k] for c in columns}


def _check_table(ds: datasets.Dataset, rows: _Collector) -> SourceRows:
    """Apply the row checks to a split already in Arrow form (parquet, hub); rows are named by index."""
    rows.check_columns(ds.column_names)
    columns = list(rows.values)
    rows.seen.update(ds.column_names)
    for i, row in _iter_table(ds, columns):
        rows.add(i, row)
        if rows.full():
            break
    rows.finish()
    if rows.labels is not None:
        # Class ids were turned into words as the rows were checked: keep the checked values.
        return rows.dataset()
    kept = ds.select_columns(columns)
    positions = None  # every row kept, in order: row i is at index i
    if len(rows.positions) < len(ds):
        kept = kept.select(rows.positions)
        positions = np.asarray(rows.positions, dtype=np.int64)
    where = RowLocator(rows.origin, "row", positions)
    return SourceRows(kept, where, rows.skipped, rows.quoted)


def _display(source: str, local: Path, file: Path) -> str:
    """The file as the user would name it: the recipe's path, joined with the split file for a directory."""
    if source.startswith("builtin:"):
        return str(file)
    return source if local.is_file() else str(Path(source) / file.name)


def load_split(data: DataSection, split: str, limit: int | None = None) -> SourceRows:
    """The usable rows of one split of the recipe's source (at most `limit`), checked under
    data.on_bad_rows; only the columns data.format reads are kept."""
    local = resolve_local_source(data.source)
    if local is None:
        origin = f"hub dataset {data.source!r}" + (f" (config {data.config!r})" if data.config else "")
        try:
            ds = datasets.load_dataset(data.source, data.config, split=split)
        except (OSError, ValueError) as e:
            # OSError covers an unreachable or unknown hub dataset (ConnectionError) and a missing split file.
            raise DataError(
                f"data.source {data.source!r} (config {data.config!r}, split {split!r}): {e}"
            ) from e
        labels = table_label_names(data, ds.features)
        return _check_table(ds, _Collector(data, f"{origin} split {split!r}", "row", limit, labels))
    file = _local_split_file(local, split)
    labels = data.label_names if data.format == "instruction" else None
    rows = _Collector(data, _display(data.source, local, file), "line", limit, labels)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows.unit = "row"
        try:
            table = pq.read_table(file)
        except (OSError, ValueError) as e:
            raise DataError(f"data.source: {rows.origin} is not a readable parquet file: {e}") from e
        # Dataset(table) reads the features `datasets` stored in the file's metadata (ClassLabel names).
        ds = datasets.Dataset(table)
        rows.labels = table_label_names(data, ds.features) if data.format == "instruction" else None
        return _check_table(ds, rows)
    if file.suffix == ".csv":
        _read_csv(file, rows)
    elif file.suffix == ".json":
        rows.unit = "row"
        _read_json(file, rows)
    else:
        _read_json_lines(file, rows)
    return rows.dataset()


# data.eval_split auto without data.val_size and without a `validation` split: this share of the training
# rows, at least one row and at most HOLDOUT_MAX.
HOLDOUT_FRACTION = 0.05
HOLDOUT_MAX = 1000


def has_split(data: DataSection, split: str) -> bool:
    """Whether the recipe's source has `split` (a {split}.ext file, or a hub split of that name)."""
    local = resolve_local_source(data.source)
    if local is not None:
        return local.is_dir() and any((local / f"{split}{suffix}").is_file() for suffix in _SUFFIXES)
    try:
        return split in datasets.get_dataset_split_names(data.source, data.config)
    except (OSError, ValueError):
        # An unreachable or unknown hub dataset: say so when its rows are loaded, naming data.source.
        return True


def eval_source(data: DataSection) -> tuple[str, bool]:
    """(split, held_out) of the evaluation rows: a split of the source, or (data.split, True) when they are
    held out of the training split (data.eval_split auto with data.val_size, or with no `validation`)."""
    if data.eval_split != "auto":
        return data.eval_split, False
    if data.val_size is None and has_split(data, "validation"):
        return "validation", False
    return data.split, True


def holdout_size(data: DataSection, rows: int) -> int:
    """How many of `rows` training rows data.val_size holds out (its default when unset)."""
    size = data.val_size
    if size is None:
        n = min(max(1, round(HOLDOUT_FRACTION * rows)), HOLDOUT_MAX)
    elif isinstance(size, float):
        n = max(1, round(size * rows))
    else:
        n = size
    if n >= rows:
        raise DataError(
            f"data.val_size: holding out {n} of the {rows} usable training rows would leave none to train "
            "on; lower data.val_size, or name an evaluation split in data.eval_split"
        )
    return n


def subset(src: SourceRows, indices: np.ndarray) -> SourceRows:
    """The rows of `src` at `indices` (in that order), still named by their original line or index."""
    positions = src.where.positions
    where = RowLocator(
        src.where.origin, src.where.unit, positions[indices] if positions is not None else indices
    )
    return SourceRows(src.rows.select(indices), where, src.skipped, src.quoted, src.labels)


def split_holdout(data: DataSection, rows: SourceRows) -> tuple[SourceRows, SourceRows]:
    """(train, eval) rows from one split: the held-out rows are a random draw seeded by data.split_seed
    from all usable rows, so they are the same on every run of the same data and never trained on,
    whatever data.max_samples / max_eval_samples keep of each side afterwards (both keep file order)."""
    n = len(rows.rows)
    perm = np.random.default_rng(data.split_seed).permutation(n)
    size = holdout_size(data, n)
    held, kept = np.sort(perm[:size]), np.sort(perm[size:])
    if data.max_eval_samples is not None:
        held = held[: data.max_eval_samples]
    if data.max_samples is not None:
        kept = kept[: data.max_samples]
    return subset(rows, kept), subset(rows, held)
