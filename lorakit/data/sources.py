"""Where rows come from (a hub dataset id, a local file or directory, or a dataset shipped with lorakit),
and which of them can be used.

Local .jsonl, .json and .csv files are read here rather than by `datasets`, for two reasons: its JSON
loader rejects a whole file for one malformed line, without saying which; and a row read here keeps its
line number, so every later complaint about it (a bad field, an over-long example, a chat template that
fails on it) names the file and line. Parquet files and hub datasets are read with pyarrow / `datasets`
and their rows are named by index. Every row is checked as it is read (lorakit.data.rows); `data.on_bad_rows`
decides whether a bad one stops the run (error) or is left out and counted (skip).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np

from lorakit.data.rows import COLUMNS_DOC, RowCollector, RowLocator, SourceRows
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# The column that names each example's source in a dataset mixture (lorakit.data.mixture); tokenizing keeps it.
SOURCE = "source"
# Suffixes a local source may have, in the order a directory is searched for {split}{suffix}.
_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
# Where the documentation explains over-long examples (printed after the error by the CLIs).
OVERLONG_DOC = "docs/data.md#over-long-examples-dataoverlong"


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


def _read_json_lines(path: Path, rows: RowCollector) -> None:
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


def _read_json(path: Path, rows: RowCollector) -> None:
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


def _read_csv(path: Path, rows: RowCollector) -> None:
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


def _check_table(ds: datasets.Dataset, rows: RowCollector) -> SourceRows:
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


def load_split(
    data: DataSection,
    split: str,
    limit: int | None = None,
    columns: dict[str, str] | None = None,
    flags: frozenset[str] = frozenset(),
) -> SourceRows:
    """The usable rows of one split of the recipe's source (at most `limit`), checked under
    data.on_bad_rows; only the columns data.format reads (or `columns`, {field: column}) are kept; those in
    `flags` hold yes/no labels (true/false or 1/0, read as bool), not text."""
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
        where = f"{origin} split {split!r}"
        return _check_table(ds, RowCollector(data, where, "row", limit, labels, columns, flags))
    file = _local_split_file(local, split)
    labels = data.label_names if data.format == "instruction" else None
    rows = RowCollector(data, _display(data.source, local, file), "line", limit, labels, columns, flags)
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
