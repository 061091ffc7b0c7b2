"""The builtin news_summaries dataset: registry, shape, and the statistics its users rely on."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from lorakit.data.samples import BUILTIN_DATASETS, builtin_dataset_dir
from lorakit.data.samples import make_news_summaries as gen
from lorakit.errors import DataError
from lorakit.testing import build_tiny_tokenizer


def _rows(split: str) -> list[dict]:
    with open(builtin_dataset_dir("news_summaries") / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_registry():
    assert "news_summaries" in BUILTIN_DATASETS
    path = builtin_dataset_dir("news_summaries")
    assert path.is_dir() and path.name == "news_summaries"
    assert {p.name for p in path.iterdir()} >= {"train.jsonl", "validation.jsonl"}


def test_unknown_builtin_name_lists_the_available_ones():
    with pytest.raises(DataError, match="builtin:news_summaries") as info:
        builtin_dataset_dir("cnn_dailymail")
    assert "'cnn_dailymail'" in str(info.value)


@pytest.mark.parametrize(("split", "count"), [("train", 1000), ("validation", 100)])
def test_rows_and_columns(split, count):
    rows = _rows(split)
    assert len(rows) == count
    for i, row in enumerate(rows):
        assert set(row) == {"article", "highlights"}, i
        assert isinstance(row["article"], str) and isinstance(row["highlights"], str), i
        assert 30 <= len(row["article"].split()) <= 400, i
        assert 10 <= len(row["highlights"].split()) <= 40, i


def test_splits_do_not_overlap():
    train = {r["article"] for r in _rows("train")}
    assert not train & {r["article"] for r in _rows("validation")}


def test_files_are_small():
    total = sum(p.stat().st_size for p in builtin_dataset_dir("news_summaries").iterdir())
    assert total < 1.5e6


def test_shipped_files_match_the_generator():
    # The generator is deterministic and the committed files are exactly its output.
    assert gen.generate() == {"train": _rows("train"), "validation": _rows("validation")}
    assert gen.generate(seed=1) == gen.generate(seed=1) != gen.generate()


def test_highlights_are_grounded_in_the_article():
    # What makes the task learnable: every number and capitalised name of a highlight is in its article.
    for split in ("train", "validation"):
        for i, row in enumerate(_rows(split)):
            words = set(re.findall(r"[A-Za-z0-9]+", row["article"].lower()))
            for token in re.findall(r"\b(?:\d+|[A-Z][a-z]+)\b", row["highlights"]):
                if token not in {"The", "A", "Researchers", "Winds"}:
                    assert token.lower() in words, (split, i, token)


def test_article_lengths_are_long_tailed(tokenizer):
    lengths = [len(ids) for ids in tokenizer([r["article"] for r in _rows("train")])["input_ids"]]
    ratio = statistics.mean(lengths) / max(lengths)
    # Padding every article to the longest wastes 1 - ratio of the slots: about three quarters.
    assert 0.15 < ratio < 0.35
    assert statistics.median(lengths) < 100 and max(lengths) <= 512
    assert sum(n > 200 for n in lengths) >= 5
