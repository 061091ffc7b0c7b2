"""The builtin dialogue_summaries dataset (SAMSum-shaped): the generator reproduces the shipped files, every
summary is grounded in its chat, the lengths are long-tailed on both sides, and it loads as a builtin."""

from __future__ import annotations

import json
import random
import re
import statistics

import pytest
from transformers import T5Config

from lorakit.data import prepare_data
from lorakit.data.samples import BUILTIN_DATASETS, builtin_dataset_dir
from lorakit.data.samples import make_dialogue_summaries as gen
from lorakit.recipe import recipe_from_dict
from lorakit.testing import TINY_MAX_LENGTH, build_tiny_tokenizer
from tests.conftest import tiny_recipe_dict

SPLITS = {"train": gen.NUM_TRAIN, "validation": gen.NUM_VALIDATION}
PROMPT = "Summarize the following dialogue:\n{input}\nSummary:\n"


def _rows(name: str, split: str) -> list[dict]:
    with open(builtin_dataset_dir(name) / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def lengths(tokenizer) -> dict[str, list[int]]:
    """Token lengths (tiny tokenizer, with its </s>) of the train dialogues and summaries."""
    rows = _rows("dialogue_summaries", "train")
    return {
        "source": [len(ids) for ids in tokenizer([r["dialogue"] for r in rows])["input_ids"]],
        "target": [len(ids) for ids in tokenizer([r["summary"] for r in rows])["input_ids"]],
    }


def _percentile(values: list[int], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _random_batch_fill(values: list[int], batch: int = 8, rounds: int = 50) -> float:
    """Mean over random micro-batches of sum(lengths) / (batch x longest): the share of a padded batch
    that is real tokens."""
    rng = random.Random(0)
    fills = []
    for _ in range(rounds):
        order = rng.sample(values, len(values))
        for i in range(0, len(order) - batch + 1, batch):
            chunk = order[i : i + batch]
            fills.append(sum(chunk) / (batch * max(chunk)))
    return statistics.mean(fills)


def test_registered_with_both_splits():
    assert BUILTIN_DATASETS["dialogue_summaries"] == "dialogue_summaries"
    path = builtin_dataset_dir("dialogue_summaries")
    assert {p.name for p in path.iterdir()} >= {"train.jsonl", "validation.jsonl"}
    assert sum(p.stat().st_size for p in path.iterdir()) < 1e6


def test_shipped_files_are_the_generators_output_byte_for_byte(tmp_path):
    written = gen.write(tmp_path)
    assert set(written) == set(SPLITS)
    for split, path in written.items():
        assert (
            path.read_bytes() == (builtin_dataset_dir("dialogue_summaries") / f"{split}.jsonl").read_bytes()
        )
    # A pure function of the seed: another seed gives other rows, the same seed the same ones.
    assert gen.generate(seed=1) == gen.generate(seed=1) != gen.generate()


@pytest.mark.parametrize(("split", "count"), SPLITS.items())
def test_rows_are_chats_with_summaries(split, count):
    rows = _rows("dialogue_summaries", split)
    assert len(rows) == count
    for i, row in enumerate(rows):
        assert set(row) == {"dialogue", "summary"}, i
        assert row["dialogue"].strip() and row["summary"].strip(), i
        turns = row["dialogue"].split("\n")
        assert all(re.fullmatch(r"[A-Z][a-z]+: \S.*", t) for t in turns), (split, i)
        speakers = {t.split(":", 1)[0] for t in turns}
        assert 2 <= len(speakers) <= 4, (split, i)


def test_splits_do_not_overlap():
    train = {r["dialogue"] for r in _rows("dialogue_summaries", "train")}
    assert not train & {r["dialogue"] for r in _rows("dialogue_summaries", "validation")}


def _one_of(values: list[str]) -> str:
    return "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))


# Summary templates as regexes, each slot matching only what the generator can put there, so a sentence
# splits into its slots in one way.
_SLOT_PATTERNS = {
    "A": r"[A-Z][a-z]+",
    "B": r"[A-Z][a-z]+",
    "n": r"\d+",
    "time": r"\d+(?::\d\d)? [ap]m",
    "day_phrase": r"(?:on )?(?:" + _one_of([*gen.DAYS, "tomorrow", "tonight"]) + ")",
    "weekday": _one_of(gen.DAYS),
    "place": _one_of(gen.PLACES),
    "venue": _one_of(gen.VENUES),
    "restaurant": _one_of(gen.RESTAURANTS),
    "event": _one_of(gen.EVENTS),
    "supplies": _one_of(gen.SUPPLIES),
    "paid": _one_of(gen.THINGS_PAID),
    "object": _one_of(gen.OBJECTS),
    "document": _one_of(gen.DOCUMENTS),
    "when": _one_of(gen.WHEN),
    "show": _one_of(gen.SHOWS),
    "pet": _one_of(gen.PETS),
    "reason": _one_of(gen.REASONS),
    "test": _one_of(gen.TESTS),
}


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    pattern = ""
    for i, part in enumerate(parts):
        pattern += re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_SLOT_PATTERNS[part]})"
    return re.compile(pattern)


TEMPLATES = {kind: _template_regex(fact["summary"]) for kind, fact in gen.FACTS.items()}


def _facts(summary: str) -> list[tuple[str, dict[str, str]]]:
    """(kind, slots) of each sentence of a summary, by the one template it matches."""
    facts = []
    for sentence in re.split(r"(?<=\.) ", summary):
        matches = [(k, m.groupdict()) for k, rx in TEMPLATES.items() if (m := rx.fullmatch(sentence))]
        assert len(matches) == 1, (sentence, [k for k, _ in matches])
        facts.append(matches[0])
    return facts


def test_every_summary_fact_is_stated_in_its_dialogue():
    sentence_counts = []
    for split in SPLITS:
        for i, row in enumerate(_rows("dialogue_summaries", split)):
            speakers = {t.split(":", 1)[0] for t in row["dialogue"].split("\n")}
            facts = _facts(row["summary"])
            sentence_counts.append(len(facts))
            assert len({kind for kind, _ in facts}) == len(facts), (split, i)
            for kind, slots in facts:
                # The people of a fact take part in the chat (other names in it are only mentioned).
                assert slots["A"] in speakers and slots.get("B", slots["A"]) in speakers, (split, i, kind)
                assert slots["A"] != slots.get("B"), (split, i, kind)
                for name, value in slots.items():
                    if name in ("A", "B"):
                        continue
                    if name == "day_phrase":
                        value = value.removeprefix("on ")
                    assert re.search(rf"(?<![\w:]){re.escape(value)}(?![\w:])", row["dialogue"]), (
                        split, i, kind, name, value,
                    )  # fmt: skip
    # One to four facts, most chats with one or two, as in SAMSum.
    counts = {n: sentence_counts.count(n) for n in range(1, 5)}
    assert sum(counts.values()) == len(sentence_counts)
    assert counts[1] > counts[2] > counts[3] > counts[4] > 0


def test_source_lengths_are_long_tailed_like_samsum(lengths):
    source = lengths["source"]
    assert 90 <= statistics.median(source) <= 115
    assert 340 <= _percentile(source, 99) <= 440
    assert min(source) >= 15
    # Room for a prompt template within the tiny models' 512 positions.
    assert max(source) <= TINY_MAX_LENGTH - 40
    fill = _random_batch_fill(source)
    assert 0.45 <= fill <= 0.6


def test_random_batches_waste_more_than_on_news_summaries(tokenizer, lengths):
    # The point of this dataset: a longer tail than news_summaries, so padding wastes more.
    articles = [r["article"] for r in _rows("news_summaries", "train")]
    news = [len(ids) for ids in tokenizer(articles)["input_ids"]]
    assert _random_batch_fill(lengths["source"]) < _random_batch_fill(news) - 0.03


def test_target_lengths_spread_with_the_number_of_facts(lengths):
    target = lengths["target"]
    assert 20 <= statistics.median(target) <= 30
    assert min(target) <= 10 and 70 <= max(target) <= 95
    assert _percentile(target, 95) >= 2 * statistics.median(target)
    # Longer chats get longer summaries, as in SAMSum.
    pairs = sorted(zip(lengths["source"], target, strict=True))
    half = len(pairs) // 2
    short, long = [t for _, t in pairs[:half]], [t for _, t in pairs[half:]]
    assert statistics.mean(long) > 1.3 * statistics.mean(short)


def test_loads_and_tokenizes_as_a_builtin_without_truncation(tokenizer, tmp_path):
    # Both splits through lorakit's data step as the tiny T5 (its tokenizer and an encoder-decoder config)
    # would read them; overlong error stops on any row over a cap.
    raw = tiny_recipe_dict(
        tmp_path / "cache",
        tmp_path / "run",
        data={
            "source": "builtin:dialogue_summaries",
            "input_column": "dialogue",
            "target_column": "summary",
            "prompt_template": PROMPT,
            "max_samples": None,
            "max_eval_samples": None,
            # The prompt and every dialogue within 40 tokens of margin under the model's 512.
            "max_source_length": TINY_MAX_LENGTH - 40,
            "max_target_length": TINY_MAX_LENGTH,
            "overlong": "error",
        },
    )
    data = prepare_data(recipe_from_dict(raw), tokenizer, T5Config())
    assert (len(data.train), len(data.eval)) == (gen.NUM_TRAIN, gen.NUM_VALIDATION)
    assert data.stats["overlong"] == {
        "policy": "error", "truncated": 0, "dropped": 0, "eval_truncated": 0, "eval_dropped": 0,
    }  # fmt: skip
    first = _rows("dialogue_summaries", "train")[0]
    assert data.train[0]["input_ids"] == tokenizer(PROMPT.format(input=first["dialogue"]))["input_ids"]
    assert data.train[0]["reference"] == first["summary"]
