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
from lorakit.data.source_files import SUFFIXES as _SUFFIXES
from lorakit.data.source_files import (
    hub_revision,
    resolve_local_source,
    sharded,
    split_data_files,
    split_files,
)
from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# The column that names each example's source in a dataset mixture (lorakit.data.mixture); tokenizing keeps it.
SOURCE = "source"
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


def source_fingerprint(data: DataSection, split: str) -> str:
    """A string that changes when the rows of this split can change: the files' sizes and times, or the
    commit a hub dataset's revision resolves to (and data.transform's source)."""
    files = split_files(data, split)
    if files is None:
        rows = f"hub:{data.source}:{data.config}:{split}:{data.data_files}:{hub_revision(data)}"
    else:
        rows = ";".join(f"file:{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    if data.transform is None:
        return rows
    from lorakit.data.rows import transform_source

    return f"{rows};transform:{data.transform}:{transform_source(data.transform)}"


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
        rows.set_unit("line")
        rows.add(1, doc)
        return
    if not isinstance(doc, list):
        rows.set_unit("line")
        _read_json_lines(path, rows)
        return
    for i, row in enumerate(doc):
        rows.add(i, row)
        if rows.full():
            return


def _read_csv(path: Path, rows: RowCollector) -> None:
    """A .csv file with a header line; every value is text (no type guessing: `007` stays `007`). A line the
    csv module rejects, or with more fields than the header, is a bad row."""
    # The csv module refuses fields over 128 KiB by default; a long document is a legitimate field. Only
    # ever raised, never lowered, so other users of the module keep at least the limit they had.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, strict=True)
        try:
            rows.check_columns(reader.fieldnames or [])
            rows.seen.update(reader.fieldnames or [])
            while not rows.full():
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    # DictReader's own line_num is updated only after a good row: ask its reader.
                    rows.add(reader.reader.line_num, None, f"not valid CSV: {e}")
                    continue
                if None in row:
                    n = len(reader.fieldnames or [])
                    rows.add(reader.line_num, None, f"{n + len(row[None])} fields, the header has {n}")
                    continue
                # A short row fills its missing fields with None: those columns are missing from it.
                rows.add(reader.line_num, {k: v for k, v in row.items() if v is not None})
        except UnicodeDecodeError:
            raise DataError(
                f"data.source: {rows.origin} is not UTF-8 text after line {reader.line_num}"
            ) from None


def _iter_table(ds: datasets.Dataset, columns: list[str]) -> Iterator[tuple[int, dict]]:
    batch_size = 1000
    table = ds.select_columns(columns)
    for start in range(0, len(ds), batch_size):
        batch = table[start : start + batch_size]
        for k in range(len(batch[columns[0]])):
            yield start + k, {c: batch[c][k] for c in columns}


def _check_table(ds: datasets.Dataset, rows: RowCollector, whole: bool = True) -> SourceRows | None:
    """Apply the row checks to a split already in Arrow form (parquet, hub); rows are named by index.
    `whole`: the table is the whole split (else one shard of several: the caller finishes the rows)."""
    for column, other in rows.aliases.items():
        if column not in ds.column_names and other in ds.column_names:
            ds = ds.rename_column(other, column)
            rows.read_from[column] = other
    if rows.transform is None:
        rows.check_columns(ds.column_names)
        wanted = set(rows.columns.values()) | ({"input"} if rows.alpaca else set())
        columns = [c for c in ds.column_names if c in wanted]
    else:
        columns = ds.column_names
    rows.seen.update(ds.column_names)
    for i, row in _iter_table(ds, columns):
        rows.add(i, row)
        if rows.full():
            break
    if not whole:
        return None
    rows.finish()
    if rows.labels is not None or rows.chat or rows.loose or rows.alpaca or rows.transform is not None:
        # Values were converted as the rows were checked (label words, messages, prompts): keep those.
        return rows.dataset()
    kept = ds.select_columns(columns)
    positions = None  # every row kept, in order: row i is at index i
    if len(rows.positions) < len(ds):
        kept = kept.select(rows.positions)
        positions = np.asarray(rows.positions, dtype=np.int64)
    where = RowLocator(rows.origin, "row", positions)
    return SourceRows(kept, where, rows.skipped, rows.quoted)


def _display(source: str, local: Path | None, file: Path) -> str:
    """The file as the user would name it: the recipe's path, joined with the split file for a directory."""
    if source.startswith("builtin:") or local is None:
        return str(file)
    if local.is_file():
        return source
    try:
        return str(Path(source) / file.relative_to(local))
    except ValueError:
        return str(file)


def _hub_split(data: DataSection, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(
            data.source, data.config, split=split, revision=data.revision, data_files=data.data_files
        )
    except (OSError, ValueError) as e:
        # OSError covers an unreachable or unknown hub dataset (ConnectionError) and a missing split file.
        raise DataError(f"data.source {data.source!r} (config {data.config!r}, split {split!r}): {e}") from e


def load_split(
    data: DataSection,
    split: str,
    limit: int | None = None,
    columns: dict[str, str] | None = None,
    flags: frozenset[str] = frozenset(),
    aliases: dict[str, str] | None = None,
) -> SourceRows:
    """The usable rows of one split of the recipe's source (at most `limit`), checked under
    data.on_bad_rows; only the columns data.format reads (or `columns`, {field: column}) are kept; those in
    `flags` hold yes/no labels (true/false or 1/0, read as bool), not text; `aliases` ({column: the column read
    instead when a source has none}) replaces the default (ShareGPT's `conversations` for chat examples)."""
    files = split_files(data, split)
    instruction = data.format == "instruction"
    if files is None:
        origin = f"hub dataset {data.source!r}" + (f" (config {data.config!r})" if data.config else "")
        rows = RowCollector(data, f"{origin} split {split!r}", "row", limit, None, columns, flags, aliases)
        ds = _hub_split(data, split)
        rows.labels = table_label_names(data, ds.features)
        return _check_table(ds, rows)
    local = resolve_local_source(data.source)
    labels = data.label_names if instruction else None
    rows = RowCollector(data, "", "line", limit, labels, columns, flags, aliases)
    for file in files:
        rows.next_file(
            _display(data.source, local, file), "row" if file.suffix in (".parquet", ".json") else "line"
        )
        if file.suffix == ".parquet":
            ds = _read_parquet(file, rows)
            if len(files) == 1:
                rows.labels = table_label_names(data, ds.features) if instruction else None
                return _check_table(ds, rows)
            _check_table(ds, rows, whole=False)
        elif file.suffix == ".csv":
            _read_csv(file, rows)
        elif file.suffix == ".json":
            _read_json(file, rows)
        else:
            _read_json_lines(file, rows)
        if rows.full():
            break
    return rows.dataset()


def _read_parquet(file: Path, rows: RowCollector) -> datasets.Dataset:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except (OSError, ValueError) as e:
        raise DataError(f"data.source: {rows.origin} is not a readable parquet file: {e}") from e
    # Dataset(table) reads the features `datasets` stored in the file's metadata (ClassLabel names).
    return datasets.Dataset(table)


# data.eval_split auto without data.val_size and without a `validation` split: this share of the training
# rows, at least one row and at most HOLDOUT_MAX.
HOLDOUT_FRACTION = 0.05
HOLDOUT_MAX = 1000


def has_split(data: DataSection, split: str) -> bool:
    """Whether the recipe's source has `split` (its files, or a hub split of that name)."""
    local = resolve_local_source(data.source)
    if local is not None:
        if data.data_files is not None and local.is_dir():
            return split_data_files(data, split) is not None
        if not local.is_dir():
            return False
        return any((local / f"{split}{suffix}").is_file() for suffix in _SUFFIXES) or bool(
            sharded(local, split)
        )
    try:
        return split in datasets.get_dataset_split_names(data.source, data.config, revision=data.revision)
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
    return SourceRows(src.rows.select(indices), src.where.take(indices), src.skipped, src.quoted, src.labels)


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
