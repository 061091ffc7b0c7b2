"""Which files hold a split of a local source (a file, a directory of {split}.ext files or shards, or
data.data_files' paths and globs), and which commit a hub dataset's revision is."""

from __future__ import annotations

from pathlib import Path

from lorakit.errors import DataError
from lorakit.recipe.schema import DataSection

# Suffixes a local source may have, in the order a directory is searched for {split}{suffix}.
SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


def resolve_local_source(source: str) -> Path | None:
    """The local path behind `source` (a file, a directory or `builtin:NAME`), or None for a hub id."""
    if source.startswith("builtin:"):
        from lorakit.data.samples import builtin_dataset_dir

        return builtin_dataset_dir(source.removeprefix("builtin:"))
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if source.startswith((".", "/", "~")) or Path(source).suffix in SUFFIXES:
        raise DataError(f"data.source: no such file or directory: {source}")
    return None


def _globbed(base: Path, pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    path = path if path.is_absolute() else base / path
    if any(ch in pattern for ch in "*?["):
        found = sorted(p for p in Path(path.anchor).glob(str(path.relative_to(path.anchor))) if p.is_file())
    else:
        found = [path] if path.is_file() else []
    if not found:
        raise DataError(f"data.data_files: {pattern!r} matches no file (relative to {base})")
    return found


def split_data_files(data: DataSection, split: str) -> list[str] | None:
    """data.data_files' patterns for `split` (None: the split is not there)."""
    given = data.data_files
    if isinstance(given, dict):
        value = given.get(split)
        return None if value is None else [value] if isinstance(value, str) else list(value)
    if split != "train":
        return None
    return [given] if isinstance(given, str) else list(given)


def sharded(path: Path, split: str) -> list[Path]:
    """A directory's shards of one split: {split}/*.ext, or {split}-*.ext at any depth (the hub's layout,
    data/train-00000-of-00004.parquet)."""
    for pattern in (f"{split}/*", f"**/{split}-*", f"**/{split}.*"):
        found = sorted(p for p in path.glob(pattern) if p.is_file() and p.suffix in SUFFIXES)
        if found:
            return found
    return []


def split_files(data: DataSection, split: str) -> list[Path] | None:
    """The local files holding one split (data.data_files, the file itself, a directory's {split}.ext or
    its shards); None for a hub dataset."""
    local = resolve_local_source(data.source)
    if data.data_files is not None and (local is not None and local.is_dir()):
        patterns = split_data_files(data, split)
        if patterns is None:
            raise DataError(f"data.data_files names no file for split {split!r}")
        files = [f for p in patterns for f in _globbed(local, p)]
    elif local is None:
        return None
    elif local.is_file():
        if split != "train":
            raise DataError(
                f"data.source is a single file, which holds only the 'train' split; split {split!r} needs "
                "a directory with one {split}.jsonl (or .json/.csv/.parquet) file per split"
            )
        files = [local]
    else:
        files = [local / f"{split}{s}" for s in SUFFIXES if (local / f"{split}{s}").is_file()][:1]
        files = files or sharded(local, split)
        if not files:
            raise DataError(
                f"data.source: directory {local} has no {split}.jsonl/.json/.csv/.parquet (nor shards "
                f"{split}/*.parquet or {split}-*.parquet) for split {split!r}"
            )
    for f in files:
        if f.suffix not in SUFFIXES:
            raise DataError(f"data.source: unsupported file type {f.suffix!r} ({f}); use {sorted(SUFFIXES)}")
    return files


def hub_revision(data: DataSection) -> str:
    """The commit data.revision (default: the main branch) of a hub dataset resolves to, or the revision as
    given when the hub cannot be asked (offline): part of the token cache key."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        return HfApi().dataset_info(data.source, revision=data.revision, timeout=10).sha or str(data.revision)
    except (OSError, ValueError, HfHubHTTPError, OfflineModeIsEnabled):
        return f"unresolved:{data.revision}"


def with_datasets(recipe, train_dataset, eval_dataset=None):
    """`recipe` reading in-memory `datasets.Dataset`s (lorakit.train's train_dataset / eval_dataset): each
    written once as parquet under data.cache_dir, named by its fingerprint, and data.source pointed there,
    so every process of the run, and the token cache, read them as any local source."""
    import hashlib

    data = recipe.data
    if isinstance(data.source, list):
        raise DataError("lorakit.train(train_dataset=...): data.source is a mixture; give one source")
    given = {"train": train_dataset} | ({"validation": eval_dataset} if eval_dataset is not None else {})
    marks = [f"{k}:{getattr(ds, '_fingerprint', None) or id(ds)}:{len(ds)}" for k, ds in given.items()]
    folder = (
        Path(data.cache_dir).expanduser()
        / "inputs"
        / hashlib.sha256(";".join(marks).encode()).hexdigest()[:20]
    )
    for split, ds in given.items():
        file = folder / f"{split}.parquet"
        if not file.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(file.with_suffix(".tmp")))
            file.with_suffix(".tmp").rename(file)
    update = {"source": str(folder), "split": "train", "data_files": None}
    if eval_dataset is not None and data.eval_split is not None:
        update.update(eval_split="validation", val_size=None)
    return recipe.model_copy(update={"data": data.model_copy(update=update)})
