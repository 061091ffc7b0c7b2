"""Datasets shipped with lorakit (`data.source: builtin:NAME`), for tests, the quickstart and benchmarks."""

from __future__ import annotations

from pathlib import Path

from lorakit.errors import DataError

# name -> directory (relative to this package) holding one {split}.jsonl per split.
BUILTIN_DATASETS: dict[str, str] = {
    "news_summaries": "news_summaries",
    "dialogue_summaries": "dialogue_summaries",
}


def builtin_dataset_dir(name: str) -> Path:
    """The directory of builtin dataset `name`; raises DataError for an unknown name."""
    if name not in BUILTIN_DATASETS:
        raise DataError(
            f"data.source: unknown builtin dataset {name!r}; available: "
            + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_DATASETS))
        )
    return Path(__file__).resolve().parent / BUILTIN_DATASETS[name]
