"""Where rows come from: a hub dataset id, a local file or directory, or a dataset shipped with lorakit."""

from __future__ import annotations

from pathlib import Path

import datasets

from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def resolve_local_source(source: str) -> Path | None:
    """The local path behind `source` (a file, a directory or `builtin:NAME`), or None for a hub id."""
    if source.startswith("builtin:"):
        from lorakit.data.samples import builtin_dataset_dir

        return builtin_dataset_dir(source.removeprefix("builtin:"))
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if source.startswith((".", "/", "~")) or Path(source).suffix in _BUILDERS:
        raise DataError(f"data.source: no such file or directory: {source}")
    return None


def _local_split_files(path: Path, split: str) -> tuple[str, str]:
    """(builder, file) for one split of a local file or directory source."""
    if path.is_file():
        builder = _BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(f"data.source: unsupported file type {path.suffix!r}; use {sorted(_BUILDERS)}")
        if split != "train":
            raise DataError(
                f"data.source is a single file, which holds only the 'train' split; split {split!r} needs "
                "a directory with one {split}.jsonl (or .json/.csv/.parquet) file per split"
            )
        return builder, str(path)
    for suffix, builder in _BUILDERS.items():
        candidate = path / f"{split}{suffix}"
        if candidate.is_file():
            return builder, str(candidate)
    raise DataError(
        f"data.source: directory {path} has no {split}.jsonl/.json/.csv/.parquet for split {split!r}"
    )


def load_split(data: DataSection, split: str) -> datasets.Dataset:
    """Load one split of the recipe's source as a datasets.Dataset."""
    local = resolve_local_source(data.source)
    try:
        if local is not None:
            builder, file = _local_split_files(local, split)
            ds = datasets.load_dataset(builder, data_files={split: file}, split=split)
        else:
            ds = datasets.load_dataset(data.source, data.config, split=split)
    except DataError:
        raise
    except (OSError, ValueError) as e:
        # OSError covers a missing file and an unreachable or unknown hub dataset (ConnectionError).
        raise DataError(f"data.source {data.source!r} (config {data.config!r}, split {split!r}): {e}") from e
    if len(ds) == 0:
        raise DataError(f"data.source {data.source!r}: split {split!r} is empty")
    missing = [c for c in (data.input_column, data.target_column) if c not in ds.column_names]
    if missing:
        field = "data.input_column" if missing[0] == data.input_column else "data.target_column"
        raise DataError(
            f"{field}: column {missing[0]!r} not found in {data.source!r} split {split!r}; "
            f"available columns: {ds.column_names}"
        )
    return ds


def source_fingerprint(data: DataSection, split: str) -> str:
    """A string that changes when the rows of this split can change (file contents or hub revision)."""
    local = resolve_local_source(data.source)
    if local is None:
        return f"hub:{data.source}:{data.config}:{split}"
    _, file = _local_split_files(local, split)
    stat = Path(file).stat()
    return f"file:{file}:{stat.st_size}:{stat.st_mtime_ns}"
