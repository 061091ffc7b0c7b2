"""Recipe input that the schema used to accept or mangle: non-finite and out-of-range numbers, repeated
keys, alias bombs, and CLI overrides of text fields (issue 44)."""

import pytest

from lorakit.errors import RecipeError
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

QUICKSTART = RECIPES / "quickstart.yaml"


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("train.lr=inf", "train.lr: Input should be a finite number"),
        ("train.lr=.nan", "train.lr: Input should be a finite number"),
        ("train.weight_decay=.inf", "train.weight_decay: Input should be a finite number"),
        ("method.alpha=-.inf", "method.alpha: Input should be a finite number"),
        ("distributed.timeout_minutes=inf", "distributed.timeout_minutes: Input should be a finite number"),
        ("output.tracker_timeout_seconds=.inf", "output.tracker_timeout_seconds: Input should be a finite"),
        ("data.val_size=.nan", "data.val_size: Input should be a finite number"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens: must be >= 1 or 'auto' (got 0)"),
        ("distributed.timeout_minutes=0", "distributed.timeout_minutes: Input should be greater than 0"),
        ("data.max_source_length=0", "data.max_source_length must be >= 1 or 'auto'"),
    ],
)
def test_a_number_out_of_range_is_refused_naming_the_field(override, line):
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICKSTART, [override])
    assert line in str(err.value)


def test_an_override_of_a_text_field_stays_text():
    recipe = load_recipe(
        QUICKSTART,
        [
            "data.prompt_template=Article: {input}\nSummary:",  # ': ' made a YAML mapping
            "model.revision=1e5",  # was the float 100000.0
            "output.dir=2024",  # was the int 2024
            "data.split=yes",  # was True
            "train.resume=123",
            "data.source=notes: draft.jsonl",  # ': ' without braces was a YAML error
        ],
    )
    assert recipe.data.prompt_template == "Article: {input}\nSummary:"
    assert recipe.model.revision == "1e5"
    assert recipe.output.dir == "2024"
    assert recipe.data.split == "yes"
    assert recipe.train.resume == "123"
    assert recipe.data.source == "notes: draft.jsonl"
    # Fields that are not free text keep YAML's types.
    typed = load_recipe(QUICKSTART, ["train.lr=2e-4", "method.target_modules=[q, v]", "data.eval_split=null"])
    assert typed.train.lr == 2e-4 and typed.method.target_modules == ["q", "v"]
    assert typed.data.eval_split is None
    with pytest.raises(
        RecipeError, match=r"method.target_modules: Input should be 'all-linear' or a valid list"
    ):
        load_recipe(QUICKSTART, ["method.target_modules=5"])


def test_a_repeated_key_is_an_error_naming_the_key_and_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(QUICKSTART.read_text() + "train:\n  lr: 1.0e-3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    top = QUICKSTART.read_text().splitlines().index("train:") + 1
    bottom = len(QUICKSTART.read_text().splitlines()) + 1
    assert f"{path} line {bottom}: key 'train' is repeated (first at line {top})" in str(err.value)
    path.write_text("model:\n  name_or_path: tiny:t5\n  dtype: float32\n  dtype: bfloat16\n")
    with pytest.raises(RecipeError, match=r"line 4: key 'dtype' is repeated \(first at line 3\)"):
        load_recipe(path)


def test_alias_expansion_is_bounded(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")  # 10**8 values once expanded
    with pytest.raises(RecipeError, match="more than 100000 values once its aliases"):
        load_recipe(path)
    # Aliases within the bound still work (a recipe may reuse a block).
    small = tmp_path / "small.yaml"
    small.write_text(QUICKSTART.read_text().replace("  epochs: 2", "  epochs: &e 2\n  log_every: *e"))
    assert load_recipe(small).train.log_every == 2


@pytest.mark.parametrize(
    "text",
    [
        "data:\n  source: " + "[" * 5000 + "]" * 5000 + "\n",  # a flow sequence nested 5000 deep
        "data:\n  source: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",  # a flow mapping
        "".join(f"{'  ' * i}k{i}:\n" for i in range(300)) + "  " * 300 + "v: 1\n",  # block mappings
    ],
    ids=["sequences", "mappings", "block"],
)
def test_recipe_nesting_is_bounded_with_one_line(tmp_path, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "nested more than 64 levels deep" in str(err.value)
    assert str(err.value).count("\n") == 0
    assert not isinstance(err.value.__context__, RecursionError)


def test_recipe_size_is_bounded(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(QUICKSTART.read_text() + "# " + "x" * (2 << 20) + "\n")
    with pytest.raises(RecipeError, match=r"larger than 1 MiB"):
        load_recipe(path)


@pytest.mark.parametrize(
    "override",
    [
        "data.source=" + "[" * 5000 + "]" * 5000,
        ".".join(["data"] * 5000) + "=1",
        "data.prompt_template=" + "x" * (2 << 20),
    ],
    ids=["deep-value", "deep-key", "huge-value"],
)
def test_overrides_are_bounded_with_one_problem_line(override):
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICKSTART, [override])
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid recipe (1 problem):"
    assert len(lines) == 2 and ("levels deep" in lines[1] or "larger than" in lines[1]), lines[1][:300]


@pytest.mark.slow  # runs the CLI in a fresh interpreter
def test_the_cli_refuses_a_deep_recipe_with_exit_2_and_one_line(tmp_path):
    from tests.conftest import run_cli

    path = tmp_path / "deep.yaml"
    path.write_text("data:\n  source: " + "[" * 20000 + "]" * 20000 + "\n")
    out = run_cli("lorakit.plan", str(path), "--gpus", "1", "--gpu-memory", "40GB")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "RecursionError" not in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2, out.stderr[-2000:]
    assert "nested more than 64 levels deep" in out.stderr
