"""docs/recipes.md is generated from the schema; it must match the generator and name every key."""

from pathlib import Path

import pytest

from lorakit.errors import RecipeError
from lorakit.recipe import recipe_from_dict
from lorakit.recipe.reference import REGENERATE, generate, main, section_models
from lorakit.recipe.schema import Recipe

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def _row(page: str, dotted: str) -> str:
    rows = [line for line in page.splitlines() if line.startswith(f"| `{dotted}` |")]
    assert len(rows) == 1, f"{dotted}: expected one table row, found {len(rows)}"
    return rows[0]


def test_committed_page_matches_the_generator():
    assert DOC.is_file(), f"docs/recipes.md is missing: run `{REGENERATE}`"
    assert DOC.read_text(encoding="utf-8") == generate(), (
        f"docs/recipes.md is out of date with the schema (lorakit/recipe/): run `{REGENERATE}`"
    )


def test_every_schema_field_appears_in_schema_order():
    page = generate()
    sections = [name for name, _ in section_models()]
    # The declared sections, then those of the registered objectives with settings (the built-ins').
    assert sections == [*Recipe.model_fields, "dpo", "orpo", "kto", "grpo"]
    positions = [page.index(f"\n## {name}\n") for name in sections]
    assert positions == sorted(positions)
    for name, model in section_models():
        assert model.__doc__.strip().splitlines()[0] in page
        for key, field in model.model_fields.items():
            assert field.description, f"{name}.{key} has no description in the schema"
            row = _row(page, f"{name}.{key}")
            assert " ".join(field.description.split()).replace("|", "\\|") in row


def test_renderings():
    page = generate()
    # A key without default is marked required; an optional one shows its default as YAML.
    assert "**required**" in _row(page, "model.name_or_path")
    assert "**required**" in _row(page, "output.dir")
    assert "**required**" not in _row(page, "train.lr")
    assert "| `0.0002` |" in _row(page, "train.lr")
    assert "| `null` |" in _row(page, "model.revision")
    assert '| `bool \\| "auto" \\| "selective"` | `auto` |' in _row(page, "model.gradient_checkpointing")
    assert "| `[rouge]` |" in _row(page, "eval.metrics")
    # Literals list their choices; unions read as YAML would (null last); ranges are shown.
    assert '`"lora" \\| "qlora" \\| "full" \\| "ia3"`' in _row(page, "method.kind")
    assert '`bool \\| "auto"`' in _row(page, "data.packing")
    assert "`str \\| null`" in _row(page, "model.revision")
    assert '`"all-linear" \\| list[str]`' in _row(page, "method.target_modules")
    assert "`0 \\| 1 \\| 2 \\| 3`" in _row(page, "distributed.zero_stage")
    assert "`float` (>= 0, < 1)" in _row(page, "method.dropout")
    assert "`int` |" in _row(page, "train.seed")


def test_intro_and_cross_field_rules():
    page = generate()
    assert "python -m lorakit.run RECIPE section.key=value" in page
    assert "unknown or misspelled key is an error" in page
    # The validators' messages are listed, one per checked key where the check loops over keys.
    assert "- distributed.offload_params needs zero_stage 3" in page
    assert "- output.merge needs output.save_adapter: true" in page
    for name in ("max_source_length", "max_target_length", "max_length"):
        assert f"- data.{name} must be >= 1 or 'auto'" in page
    assert "## Rules across sections" in page
    assert "- eval.metrics is empty while eval.generate is true" in page


def test_unknown_key_error_points_at_the_page():
    with pytest.raises(RecipeError, match="docs/recipes.md"):
        recipe_from_dict({"model": {"name_or_path": "tiny:t5", "nmae": 1}, "data": {"source": "x"}})


def test_cli_prints_and_writes(tmp_path, capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == generate()
    target = tmp_path / "sub" / "recipes.md"
    assert main(["--write", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == generate()
    assert [p.name for p in target.parent.iterdir()] == ["recipes.md"]  # no temporary file left behind
    assert target.stat().st_mode & 0o444 == 0o444  # readable like any written file, not mkstemp's 0600
