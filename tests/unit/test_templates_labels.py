"""Prompts from any columns, class ids as label words, held-out evaluation rows, and the classification
report: MNLI as text-to-text (docs/data.md)."""

import json

import numpy as np
import pytest

from lorakit.data import prepare_data
from lorakit.data.sources import load_split
from lorakit.data.templates import fit_prompt, render_prompt, render_target
from lorakit.errors import DataError, RecipeError
from lorakit.evaluation.classify import classification_report, plot_confusion_matrix
from lorakit.model import load_config, load_tokenizer
from lorakit.recipe import recipe_from_dict
from lorakit.recipe.schema import placeholders
from tests.conftest import tiny_recipe_dict

MNLI = {
    "source": "builtin:mnli_sample",
    "prompt_template": "mnli hypothesis: {hypothesis} premise: {premise}",
    "target_column": "label",
    "eval_split": "validation_mismatched",
    "max_samples": 64,
    "max_eval_samples": 16,
}


def _recipe(tmp_path, **data):
    return recipe_from_dict(tiny_recipe_dict(tmp_path / "cache", tmp_path / "run", data=data))


def _prepare(cache_dir, tmp_path, **data):
    recipe = recipe_from_dict(tiny_recipe_dict(cache_dir, tmp_path / "run", data=data))
    source, config = load_config(recipe)
    return prepare_data(recipe, load_tokenizer(recipe, source), config)


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_placeholders_are_plain_column_names():
    assert placeholders("mnli hypothesis: {hypothesis} premise: {premise} {{literal}} {premise}") == [
        "hypothesis",
        "premise",
    ]
    for bad in ("{a.b}", "{0}", "{x:>3}", "{x!r}", "open {", "close }"):
        with pytest.raises(ValueError):
            placeholders(bad)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"prompt_template": "no column"}, r"data\.prompt_template names no column"),
        ({"prompt_template": "{premise.x}"}, r"data\.prompt_template has a bad placeholder"),
        ({"target_template": "plain"}, r"data\.target_template names no column"),
        ({"label_names": ["yes"]}, r"data\.label_names: give at least two"),
        ({"val_size": 1.5}, r"data\.val_size: a fraction must be between 0 and 1"),
        (
            {"val_size": 10, "eval_split": "validation"},
            r"data\.val_size holds rows out .*data\.eval_split is .validation.",
        ),
    ],
)
def test_schema_refuses_bad_templates_labels_and_holdouts(tmp_path, data, message):
    with pytest.raises(RecipeError, match=message):
        _recipe(tmp_path, **data)


def test_class_ids_become_the_datasets_label_names(tmp_path):
    data = _recipe(tmp_path, **MNLI).data
    rows = load_split(data, "validation_mismatched", limit=5)
    assert rows.labels == ["entailment", "neutral", "contradiction"]
    row = rows.rows[0]
    assert set(row) == {"premise", "hypothesis", "label"}
    assert render_prompt(data, row) == f"mnli hypothesis: {row['hypothesis']} premise: {row['premise']}"
    assert render_target(data, row) in rows.labels
    # label_names rename the classes, one word per class id.
    renamed = _recipe(tmp_path, **MNLI, label_names=["yes", "maybe", "no"]).data
    assert load_split(renamed, "validation_mismatched", limit=5).rows["label"][0] in {"yes", "maybe", "no"}
    with pytest.raises(DataError, match=r"data\.label_names has 2 words but column 'label' has 3 classes"):
        load_split(_recipe(tmp_path, **MNLI, label_names=["yes", "no"]).data, "validation_mismatched", 5)


def test_a_missing_template_column_names_the_template_and_the_columns(tmp_path):
    data = _recipe(tmp_path, **{**MNLI, "prompt_template": "{premise} / {hypotesis}"}).data
    with pytest.raises(
        DataError,
        match=r"data\.prompt_template \{hypotesis\}: column 'hypotesis' not found.*"
        r"'hypothesis'",
    ):
        load_split(data, "train", limit=4)


def test_integer_labels_in_jsonl_need_names_and_stay_in_range(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"q": "a", "label": 0}, {"q": "b", "label": 1}, {"q": "c", "label": 5}]
    )
    base = {"source": path, "prompt_template": "question: {q}", "target_column": "label", "eval_split": None}
    with pytest.raises(
        DataError, match=r"line 1: column 'label' is the class id 0, not text; give data\.label"
    ):
        load_split(_recipe(tmp_path, **base).data, "train")
    named = _recipe(tmp_path, **base, label_names=["no", "yes"], on_bad_rows="skip").data
    rows = load_split(named, "train")
    assert rows.rows["label"] == ["no", "yes"] and rows.skipped == 1
    assert "line 3: column 'label' is the class id 5, outside 0..1" in rows.quoted[0]
    # With labels known, a text target must be one of them.
    text = _jsonl(tmp_path / "t.jsonl", [{"q": "a", "label": "yes"}, {"q": "b", "label": "perhaps"}])
    with pytest.raises(DataError, match=r"line 2: column 'label' is 'perhaps', not one of the labels"):
        load_split(_recipe(tmp_path, **{**base, "source": text}, label_names=["no", "yes"]).data, "train")


def test_target_template_and_multi_column_truncation_keep_the_template(cache_dir, tmp_path):
    long = " ".join(["word"] * 300)
    path = _jsonl(
        tmp_path / "train.jsonl",
        [{"a": f"first {long}", "b": "short second", "t": "x", "k": "y"} for _ in range(4)],
    )
    data = _prepare(
        cache_dir,
        tmp_path,
        source=path,
        eval_split=None,
        prompt_template="A: {a} B: {b} end",
        target_template="{t}-{k}",
        max_source_length=40,
        max_samples=None,
    )
    assert data.train["reference"] == ["x-y"] * 4
    assert data.stats["truncated_sources"] == 4 and all(len(ids) <= 40 for ids in data.train["input_ids"])


def test_fit_prompt_shares_the_budget_longest_field_cut_most(cache_dir, tmp_path):
    recipe = _recipe(tmp_path, prompt_template="A: {a} B: {b} end", input_column="a", target_column="t")
    source, _ = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    row = {"a": " ".join(["alpha"] * 50), "b": "beta gamma"}
    text = fit_prompt(recipe.data, row, tok, budget=12)
    assert text.startswith("A: alpha") and text.endswith(" B: beta gamma end")  # short field whole
    fields = tok(text.removeprefix("A: ").split(" B: ")[0], add_special_tokens=False)["input_ids"]
    assert len(fields) + len(tok("beta gamma", add_special_tokens=False)["input_ids"]) <= 12


def test_eval_split_auto_uses_validation_when_the_source_has_one(cache_dir, tmp_path):
    data = _prepare(cache_dir, tmp_path, eval_split="auto", max_samples=16, max_eval_samples=4)
    assert data.stats["eval_source"] == {"split": "validation", "held_out": False, "rows": 4}


def test_a_single_file_holds_out_stable_disjoint_eval_rows(cache_dir, tmp_path):
    rows = [{"input": f"question number {i}", "target": f"answer {i}"} for i in range(200)]
    path = _jsonl(tmp_path / "all.jsonl", rows)
    common = dict(source=path, input_column="input", target_column="target", prompt_template="{input}")
    first = _prepare(
        cache_dir, tmp_path, **common, eval_split="auto", max_samples=None, max_eval_samples=None
    )
    assert first.stats["eval_source"] == {"split": "train", "held_out": True, "rows": 10}  # 5% of 200
    train, held = set(first.train["reference"]), set(first.eval["reference"])
    assert len(train) == 190 and len(held) == 10 and not train & held
    # The same held-out rows however many training rows are kept; a count or a fraction sizes it.
    fewer = _prepare(cache_dir, tmp_path, **common, eval_split="auto", max_samples=50, max_eval_samples=None)
    assert set(fewer.eval["reference"]) == held and len(fewer.train) == 50
    assert not set(fewer.train["reference"]) & held
    sized = _prepare(cache_dir, tmp_path, **common, val_size=0.25, max_samples=None, max_eval_samples=None)
    assert len(sized.eval) == 50 and len(sized.train) == 150
    other = _prepare(
        cache_dir, tmp_path, **common, val_size=10, split_seed=1, max_samples=None, max_eval_samples=None
    )
    assert len(other.eval) == 10 and set(other.eval["reference"]) != held
    with pytest.raises(DataError, match=r"data\.val_size: holding out 200 of the 200"):
        _prepare(cache_dir, tmp_path, **common, val_size=200, max_samples=None, max_eval_samples=None)


def test_classification_report_counts_invalid_predictions(tmp_path):
    labels = ["entailment", "neutral", "contradiction"]
    predictions = ["Entailment", "neutral ", "maybe", "contradiction", "neutral"]
    references = ["entailment", "neutral", "neutral", "contradiction", "contradiction"]
    r = classification_report(predictions, references, labels)
    assert r["confusion_matrix"] == [[1, 0, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0]]
    assert r["columns"][-1] == "(invalid)" and r["invalid"] == 1 and r["accuracy"] == pytest.approx(3 / 5)
    assert r["per_class"]["neutral"] == {
        "support": 2,
        "predicted": 2,
        "correct": 1,
        "precision": 0.5,
        "recall": 0.5,
    }
    assert sum(map(sum, r["confusion_matrix"])) == len(predictions)
    plot_confusion_matrix(r, tmp_path / "cm.png")
    assert (tmp_path / "cm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="reference 'other' is not one of the labels"):
        classification_report(["x"], ["other"], labels)
    assert np.array(r["confusion_matrix"]).shape == (3, 4)
