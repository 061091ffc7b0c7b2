"""A 3:1 dataset mixture trained end to end: counts per source in summary.json, eval metrics per source."""

import math
from pathlib import Path

import pytest

import lorakit
from lorakit.data.cache import load_cached
from lorakit.data.sources import SOURCE
from tests.conftest import tiny_recipe
from tests.unit.test_mixture import DIALOGUES, NEWS


@pytest.mark.slow
def test_a_three_to_one_mixture_trains_and_reports_each_source(cache_dir, tmp_path):
    sources = [{**NEWS, "weight": 3}, {**DIALOGUES, "weight": 1, "name": "chats"}]
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        data={"source": sources, "max_samples": 64, "max_eval_samples": 6},
        train={"max_steps": 3},
    )
    summary = lorakit.train(recipe).summary
    per_source = summary["data"]["sources"]
    assert {n: per_source[n]["train"]["examples"] for n in ("news_summaries", "chats")} == {
        "news_summaries": 48,
        "chats": 16,
    }
    ev = summary["eval"]
    for name in ("news_summaries", "chats"):
        assert math.isfinite(ev[f"{name}/loss"]) and 0 <= ev[f"{name}/rouge1"] <= 100
    # The two sources' losses are the parts of the overall token-weighted loss, and really differ by source.
    splits, _ = load_cached(Path(summary["data"]["cache_dir"]))
    tokens = {"news_summaries": 0, "chats": 0}
    for source, labels in zip(splits["eval"][SOURCE], splits["eval"]["labels"], strict=True):
        tokens[source] += sum(1 for t in labels if t != -100)
    weighted = sum(ev[f"{n}/loss"] * t for n, t in tokens.items()) / sum(tokens.values())
    assert weighted == pytest.approx(ev["loss"], rel=1e-6)
    assert ev["news_summaries/loss"] != pytest.approx(ev["chats/loss"], rel=1e-3)
