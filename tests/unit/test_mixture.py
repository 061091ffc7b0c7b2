"""Dataset mixtures: several sources with their own columns and templates, drawn by weight (docs/data.md)."""

import pytest

from lorakit.data import prepare_data
from lorakit.data.mixture import allocate
from lorakit.errors import DataError, RecipeError
from lorakit.model import load_config, load_tokenizer
from lorakit.recipe import recipe_from_dict
from lorakit.recipe.schema import SourceSpec
from tests.conftest import tiny_recipe_dict

NEWS = {
    "source": "builtin:news_summaries",
    "input_column": "article",
    "target_column": "highlights",
    "prompt_template": "Summarize the following news article:\n{input}\nSummary:\n",
}
DIALOGUES = {
    "source": "builtin:dialogue_summaries",
    "input_column": "dialogue",
    "target_column": "summary",
    "prompt_template": "Summarize the dialogue:\n{input}\n",
}


def _prepare(cache_dir, tmp_path, sources, model="tiny:t5", **data):
    raw = tiny_recipe_dict(
        cache_dir, tmp_path / "run", model={"name_or_path": model}, data={"source": sources, **data}
    )
    recipe = recipe_from_dict(raw)
    source, config = load_config(recipe)
    return prepare_data(recipe, load_tokenizer(recipe, source), config)


def test_allocation_follows_weights_and_fixed_counts():
    specs = [SourceSpec(source="a", weight=3), SourceSpec(source="b", weight=1)]
    assert allocate(specs, [1000, 1000], 400) == [300, 100]
    assert allocate(specs, [1000, 1000], 401) == [301, 100]  # largest remainder: sums to the total
    # No total: as many as the sources hold without repeating a row (b runs out first: 200 = 4 x 50).
    assert allocate(specs, [1000, 50], None) == [150, 50]
    fixed = [SourceSpec(source="a", max_samples=30), SourceSpec(source="b"), SourceSpec(source="c", weight=1)]
    assert allocate(fixed, [100, 20, 500], 100) == [30, 20, 50]
    with pytest.raises(DataError, match=r"data\.source 'a': its weight asks for 300 .* has 10 usable rows"):
        allocate(specs, [10, 1000], 400)


def test_schema_checks_mixture_entries(tmp_path):
    def build(sources):
        return recipe_from_dict(tiny_recipe_dict(tmp_path, tmp_path / "run", data={"source": sources}))

    with pytest.raises(RecipeError, match="give a weight or max_samples, not both"):
        build([{**NEWS, "weight": 1, "max_samples": 3}])
    with pytest.raises(RecipeError, match="two sources share a name"):
        build([NEWS, NEWS])
    with pytest.raises(RecipeError, match="an empty list"):
        build([])
    with pytest.raises(RecipeError, match=r"data\.source\[\]\.prompt_template names no column"):
        build([{**NEWS, "prompt_template": "nothing"}])


def test_a_three_to_one_mixture_keeps_names_counts_and_templates(cache_dir, tmp_path):
    sources = [{**NEWS, "weight": 3}, {**DIALOGUES, "weight": 1, "name": "chats"}]
    data = _prepare(cache_dir, tmp_path, sources, max_samples=200, max_eval_samples=8)
    assert len(data.train) == 200 and sorted(set(data.train["source"])) == ["chats", "news_summaries"]
    info = data.stats["sources"]
    assert info["news_summaries"]["train"]["examples"] == 150 and info["chats"]["train"]["examples"] == 50
    assert info["news_summaries"]["weight"] == 3 and info["chats"]["available"] == 1000
    assert sum(e["train"]["tokens"] for e in info.values()) == sum(data.train["length"])
    # Each source's own eval rows (its validation split), at most max_eval_samples each.
    assert info["chats"]["eval"]["examples"] == 8 and len(data.eval) == 16
    # Each source kept its own template.
    recipe = recipe_from_dict(tiny_recipe_dict(cache_dir, tmp_path / "x"))
    tok = load_tokenizer(recipe, load_config(recipe)[0])
    texts = {}
    for name, ids in zip(data.train["source"], data.train["input_ids"], strict=True):
        texts.setdefault(name, tok.decode(ids, skip_special_tokens=True))
    assert texts["news_summaries"].startswith("Summarize the following news article:")
    assert texts["chats"].startswith("Summarize the dialogue:")
    # The same recipe reuses the cache; another weight does not.
    assert _prepare(cache_dir, tmp_path, sources, max_samples=200, max_eval_samples=8).cache_hit
    other = [{**NEWS, "weight": 1}, {**DIALOGUES, "weight": 1, "name": "chats"}]
    again = _prepare(cache_dir, tmp_path, other, max_samples=200, max_eval_samples=8)
    assert not again.cache_hit and again.stats["sources"]["chats"]["train"]["examples"] == 100


def test_a_causal_mixture_packs(cache_dir, tmp_path):
    sources = [{**NEWS, "max_samples": 40}, {**DIALOGUES, "weight": 1, "eval_split": None}]
    data = _prepare(
        cache_dir, tmp_path, sources, model="tiny:llama", max_samples=100, packing=True, max_eval_samples=4
    )
    info = data.stats["sources"]
    assert (
        info["news_summaries"]["train"]["examples"] == 40
        and info["dialogue_summaries"]["train"]["examples"] == 60
    )
    assert set(data.eval["source"]) == {"news_summaries"} and len(data.eval) == 4
    assert "prompt_ids" in data.train.column_names and all(n > 0 for n in data.train["length"])
