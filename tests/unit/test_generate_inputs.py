"""lorakit.inference.prompts: input lines (JSON rows, plain text) become the prompts a run was trained on,
and a line that cannot is named with what is wrong."""

import pytest

from lorakit.errors import DataError
from lorakit.inference.prompts import Prompter
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

MNLI = load_recipe(
    RECIPES / "quickstart_mnli.yaml"
).data  # "mnli hypothesis: {hypothesis} premise: {premise}"
NEWS = load_recipe(RECIPES / "quickstart.yaml").data  # "Summarize ...\n{input}\nSummary:\n", input = article


def test_json_rows_are_rendered_with_the_template_and_keep_their_columns():
    (row,) = Prompter(MNLI).rows([{"premise": "P.", "hypothesis": "H.", "id": 7}])
    assert row.prompt == "mnli hypothesis: H. premise: P."
    assert row.columns == {"premise": "P.", "hypothesis": "H.", "id": 7}


def test_text_lines_fill_a_one_column_template(tmp_path):
    f = tmp_path / "in.txt"
    f.write_text('first article\n\n"second\\narticle"\n{"article": "third"}\n')
    rows = Prompter(NEWS).rows(f)
    assert [r.columns for r in rows] == [
        {"article": "first article"},
        {"article": "second\narticle"},
        {"article": "third"},
    ]
    assert rows[1].prompt == "Summarize the following news article:\nsecond\narticle\nSummary:\n"
    assert [r.where for r in rows] == [f"{f} line 1", f"{f} line 3", f"{f} line 4"]  # blank lines skipped


def test_without_a_recipe_inputs_are_used_as_given():
    rows = Prompter(None).rows(["as given", {"input": "also as given", "id": 1}])
    assert [r.prompt for r in rows] == ["as given", "also as given"]
    assert rows[0].columns == {"input": "as given"}


@pytest.mark.parametrize(
    ("data", "line", "expected"),
    [
        (MNLI, '{"premise": "P."}', "line 1: column 'hypothesis' is missing"),
        (MNLI, '{"premise": "P."}', "the row has the columns ['premise']"),
        (MNLI, "plain text", "line 1: not a JSON object, but the prompt template"),
        (MNLI, '{"premise": "P.", "hypothesis": null}', "column 'hypothesis' is null"),
        (MNLI, '{"premise": "P.", "hypothesis": "H.", "label": 0}', "column 'label' has the name of a field"),
        (NEWS, '{"article": "A", ', "line 1: starts with { but is not a JSON object"),
        (None, '{"text": "no input column"}', "column 'input' is missing"),
    ],
)
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path, data, line, expected):
    f = tmp_path / "in.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(DataError) as e:
        Prompter(data, writes_label=True).rows(f)
    assert expected in str(e.value) and str(f) in str(e.value)
    assert e.value.doc_link() == "docs/inference.md#inputs"


def test_an_input_without_rows_is_refused(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n  \n")
    with pytest.raises(DataError, match="no input rows"):
        Prompter(MNLI).rows(f)
