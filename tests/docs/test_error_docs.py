"""Errors point to the page that explains the fix: `see docs/PAGE.md#ANCHOR` after the message."""

from __future__ import annotations

import pickle

from lorakit.cli import error_message
from lorakit.errors import AdapterError, DataError, LorakitError, RecipeError
from lorakit.merge import main as merge_main
from lorakit.run import main as run_main
from tests.conftest import RECIPES


def test_the_message_then_the_page():
    assert error_message(DataError("row 7: no 'text'", doc="docs/data.md#bad-rows")) == (
        "error: row 7: no 'text'\nsee docs/data.md#bad-rows"
    )
    assert error_message(LorakitError("no page for this one")) == "error: no page for this one"


def test_the_errors_know_the_recipe_sections_of_the_schema():
    from lorakit.errors import RECIPE_SECTIONS, recipe_sections
    from lorakit.recipe.known_objectives import settings_sections
    from lorakit.recipe.schema import Recipe

    assert RECIPE_SECTIONS == tuple(Recipe.model_fields)
    # The registered objectives' sections (the built-ins' with settings: dpo, orpo, kto, grpo) follow.
    objectives = tuple(name for name, _ in settings_sections())
    assert objectives == ("dpo", "orpo", "kto", "grpo") and recipe_sections() == RECIPE_SECTIONS + objectives
    assert RecipeError("invalid recipe:\n  kto.beta: must be > 0").doc_link() == "docs/recipes.md#kto"


def test_recipe_errors_link_the_section_of_the_field_they_name():
    assert RecipeError("invalid recipe:\n  train.lr: must be > 0").doc_link() == "docs/recipes.md#train"
    assert (
        RecipeError("eval.metrics is empty while eval.generate is true").doc_link() == "docs/recipes.md#eval"
    )
    # A path is not a field; a message without a field has no link; an explicit page wins.
    assert RecipeError("recipe file not found: my/data.yaml").doc_link() is None
    assert (
        RecipeError("model.dtype float16: ...", doc="docs/qlora.md#install").doc_link()
        == "docs/qlora.md#install"
    )


def test_a_class_can_give_every_instance_its_page():
    class Stopped(LorakitError):
        doc = "docs/resume.md#exit-codes"

    assert Stopped("stopped").doc_link() == "docs/resume.md#exit-codes"
    assert Stopped("stopped", doc="docs/resume.md").doc_link() == "docs/resume.md"
    assert LorakitError("plain").doc_link() is None


def test_the_page_survives_pickling():
    err = pickle.loads(pickle.dumps(AdapterError("empty adapter", doc="docs/merge.md#what-is-checked")))
    assert type(err) is AdapterError and str(err) == "empty adapter"
    assert err.doc_link() == "docs/merge.md#what-is-checked"


def test_the_commands_print_it(tmp_path, capsys):
    code = run_main(
        [str(RECIPES / "quickstart.yaml"), "train.learnig_rate=1e-4", f"output.dir={tmp_path / 'run'}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "train.learnig_rate: unknown key" in err
    assert err.rstrip().endswith("see docs/recipes.md#train") and not (tmp_path / "run").exists()
    code = merge_main([str(tmp_path / "nowhere"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.rstrip().endswith("see docs/merge.md#options")
