"""A plugin objective with settings of its own (tests/unit/scaled_objective.py: one module and its
registration, nothing else in lorakit touched) validates its recipe section, trains, resumes and reports."""

from __future__ import annotations

import importlib
import json

import pytest

import lorakit
from lorakit.errors import RecipeError
from lorakit.objectives import register, unregister
from lorakit.recipe.reference import generate
from lorakit.report import read_run
from tests.conftest import tiny_recipe

PLUGIN = "tests.unit.scaled_objective"


@pytest.fixture
def plugin():
    module = importlib.import_module(PLUGIN)
    register(module.ScaledTokens, module.ScaledSettings)  # again, should an earlier test have unregistered it
    yield module
    unregister(module.NAME)


def _recipe(cache_dir, out, section=None, **train):
    sections = {"train": {"objective": "scaled_tokens", "objective_module": PLUGIN, **train}}
    if section is not None:
        sections["scaled_tokens"] = section
    return tiny_recipe(cache_dir, out, eval={"generate": False}, checkpoint={"every": 1}, **sections)


def test_the_section_is_validated_by_the_registered_model(plugin, cache_dir, tmp_path):
    assert _recipe(cache_dir, tmp_path, {"scale": 3}).scaled_tokens.scale == 3.0
    assert _recipe(cache_dir, tmp_path).scaled_tokens == plugin.ScaledSettings()  # defaults filled in
    with pytest.raises(RecipeError) as e:
        _recipe(cache_dir, tmp_path, {"scale": -1, "scael": 2})
    assert "scaled_tokens.scale: Input should be greater than 0" in str(e.value)
    assert "scaled_tokens.scael: unknown key" in str(e.value)
    assert e.value.doc_link() == "docs/recipes.md#scaled_tokens"
    with pytest.raises(RecipeError, match="the scaled_tokens section is read only with train.objective"):
        tiny_recipe(cache_dir, tmp_path, scaled_tokens={"scale": 3})
    # The generated reference lists the section while the objective is registered.
    page = generate()
    assert "\n## scaled_tokens\n" in page and "| `scaled_tokens.scale` | `float` (> 0) | `2.0` |" in page
    unregister(plugin.NAME)
    with pytest.raises(RecipeError, match="scaled_tokens: unknown key"):
        tiny_recipe(cache_dir, tmp_path, scaled_tokens={"scale": 3})
    assert "## scaled_tokens" not in generate()


def _train_records(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def test_it_trains_resumes_and_reports(plugin, cache_dir, tmp_path):
    out = tmp_path / "run"
    first = lorakit.train(_recipe(cache_dir, out, {"scale": 3}, max_steps=2, lr=1e-2))
    straight = _train_records(out)
    assert first.summary["steps"] == 2 and [r["step"] for r in straight] == [1, 2]
    assert all(r["loss"] == pytest.approx(3 * r["ce"], rel=1e-5) for r in straight)
    # Resumed from step 1 (the objective and its section read again from the recipe): step 2 as before.
    step1 = str(out / "checkpoints" / "step-00000001")
    resumed = lorakit.train(_recipe(cache_dir, out, {"scale": 3}, max_steps=2, lr=1e-2, resume=step1))
    assert resumed.summary["resumed_from"]["step"] == 1 and resumed.summary["steps"] == 2
    again = [r for r in _train_records(out) if r["step"] == 2][-1]
    assert again["loss"] == pytest.approx(straight[1]["loss"], rel=1e-5)
    # summary.json records the objective and its settings' label; compare reads it from there.
    assert resumed.summary["objective"] == "scaled_tokens"
    assert "scaled_tokens scale=3" in resumed.summary["method_options"]
    row = read_run(out)
    assert row.objective == "scaled_tokens" and row.loss_label == "scaled_tokens"
    assert "scaled_tokens loss" in row.eval
