"""Datasets shipped with lorakit (`data.source: builtin:NAME`), for tests, the quickstart and benchmarks."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorakit.errors import DataError

# name -> directory (relative to this package) holding one {split}.jsonl (or .parquet) per split.
BUILTIN_DATASETS: dict[str, str] = {
    "news_summaries": "news_summaries",
    "dialogue_summaries": "dialogue_summaries",
    # {split}.parquet: GLUE MNLI's columns and split names (make_mnli_sample.py).
    "mnli_sample": "mnli_sample",
    # (prompt, chosen, rejected) pairs for DPO (make_preference_pairs.py).
    "preference_pairs": "preference_pairs",
    # unpaired (prompt, completion, label) rows for KTO (make_kto_rows.py).
    "kto_rows": "kto_rows",
}


def builtin_dataset_dir(name: str) -> Path:
    """The directory of builtin dataset `name`; raises DataError for an unknown name."""
    if name not in BUILTIN_DATASETS:
        raise DataError(
            f"data.source: unknown builtin dataset {name!r}; available: "
            + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_DATASETS))
        )
    return Path(__file__).resolve().parent / BUILTIN_DATASETS[name]


def write_splits(splits: dict[str, list[dict[str, str]]], out_dir: Path) -> dict[str, Path]:
    """Write each split's rows as {split}.jsonl into `out_dir` (what the generators next to this module
    ship); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        path = out_dir / f"{split}.jsonl"
        # newline="\n" so the files are byte-identical on Windows too.
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[split] = path
    return paths


@dataclass(frozen=True)
class SampleGenerator:
    """How a builtin dataset is made: `make_example(rng)` rows for train, then validation, all drawn from
    one random.Random(seed), so the files are a pure function of the seed."""

    name: str
    make_example: Callable[[random.Random], dict[str, str]]
    seed: int
    num_train: int
    num_validation: int

    def generate(self, seed: int | None = None) -> dict[str, list[dict[str, str]]]:
        """All splits as lists of rows (the shipped seed by default)."""
        rng = random.Random(self.seed if seed is None else seed)
        rows = [self.make_example(rng) for _ in range(self.num_train + self.num_validation)]
        return {"train": rows[: self.num_train], "validation": rows[self.num_train :]}

    def write(self, out_dir: Path, seed: int | None = None) -> dict[str, Path]:
        """Write {split}.jsonl files into `out_dir`; returns the paths written."""
        return write_splits(self.generate(seed), out_dir)

    def main(self) -> None:
        """Regenerate the shipped files (`python -m lorakit.data.samples.make_NAME`)."""
        for split, path in self.write(builtin_dataset_dir(self.name)).items():
            print(f"{split}: {path} ({path.stat().st_size} bytes)")
