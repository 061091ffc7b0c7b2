"""Recipes read back are data (issue 56, class 1): a run directory's recipe.yaml, a model card's recipe and
a pushed one grant no trust (model.trust_remote_code, model.allow_pickle) and import no code
(train.objective_module, data.transform) unless the person running the command grants it with a flag
(--trust-remote-code, --allow-pickle, --allow-code MODULE) or a keyword argument; validating a recipe
imports nothing. Every command that reads a recipe back is tried: merge (locate), generate (find_trained,
also from a model card), evaluate (evaluation_recipe), push (its recipe parse), output.merge's own call."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lorakit import rundir
from lorakit.recipe import Recipe, recipe_from_dict
from lorakit.recipe.read_back import NotGranted
from tests.conftest import ROOT, tiny_recipe_dict

# A module that, once imported, leaves a file behind: the proof that a recipe's code ran.
EVIL = "import pathlib, os\npathlib.Path(os.environ['LORAKIT_TEST_MARK']).write_text('ran')\n"


@pytest.fixture
def evil(tmp_path, monkeypatch) -> Path:
    """A module `evil_code` on sys.path (as the working directory is under `python -m`); returns the file its
    import would write."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "evil_code.py").write_text(EVIL + "def transform(row):\n    return row\n")
    mark = tmp_path / "imported"
    monkeypatch.setenv("LORAKIT_TEST_MARK", str(mark))
    monkeypatch.syspath_prepend(str(code))
    yield mark
    sys.modules.pop("evil_code", None)


def _run_dir(tmp_path, cache_dir, *, adapter=True, **sections) -> Path:
    run = tmp_path / "run"
    raw = tiny_recipe_dict(cache_dir, run, **sections)
    run.mkdir(parents=True, exist_ok=True)
    (run / rundir.RECIPE).write_text(yaml.safe_dump(raw))
    if adapter:
        (run / rundir.ADAPTER).mkdir()
        (run / rundir.ADAPTER / "adapter_config.json").write_text("{}")
    return run


PLUGIN = {"train": {"objective": "evil_objective", "objective_module": "evil_code"}}
TRANSFORM = {"data": {"source": "builtin:news_summaries", "transform": "evil_code:transform"}}


def test_validating_a_recipe_imports_nothing(evil, cache_dir, tmp_path):
    raw = tiny_recipe_dict(cache_dir, tmp_path / "run")
    raw["train"]["objective_module"] = "evil_code"
    raw["data"]["transform"] = "evil_code:transform"
    recipe = Recipe.model_validate(raw)
    assert recipe.train.objective_module == "evil_code" and not evil.exists()
    # The caller's own dict is the caller's: its objective module is imported, by the loader.
    recipe_from_dict(raw)
    assert evil.exists()


def test_merge_refuses_a_run_directorys_code_and_imports_nothing(evil, cache_dir, tmp_path):
    from lorakit.export.sources import locate

    run = _run_dir(tmp_path, cache_dir, train=PLUGIN["train"])
    with pytest.raises(NotGranted) as err:
        locate(run)
    message = str(err.value)
    assert "train.objective_module" in message and "--allow-code evil_code" in message
    assert "\n" not in message and not evil.exists()


def test_generate_refuses_a_run_directorys_and_a_model_cards_code(evil, cache_dir, tmp_path):
    from lorakit.export.card import CARD
    from lorakit.inference.model import find_trained

    run = _run_dir(tmp_path, cache_dir, train=PLUGIN["train"])
    with pytest.raises(NotGranted, match=r"train.objective_module .* --allow-code evil_code"):
        find_trained(run)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    text = (run / rundir.RECIPE).read_text()
    (merged / CARD).write_text(f"# model\n\n## Recipe\n\n```yaml\n{text.rstrip()}\n```\n")
    with pytest.raises(NotGranted, match=rf"{CARD}: train.objective_module .* --allow-code evil_code"):
        find_trained(merged)
    assert not evil.exists()


def test_a_card_or_run_directory_asking_for_trust_is_refused_unless_the_caller_grants_it(cache_dir, tmp_path):
    from lorakit.export.card import CARD
    from lorakit.inference.model import find_trained

    run = _run_dir(tmp_path, cache_dir, model={"name_or_path": "tiny:t5", "trust_remote_code": True})
    with pytest.raises(NotGranted, match=r"model.trust_remote_code is true.*--trust-remote-code"):
        find_trained(run)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    text = yaml.safe_dump({**yaml.safe_load((run / rundir.RECIPE).read_text()), "model": {
        "name_or_path": "tiny:t5", "allow_pickle": True}})  # fmt: skip
    (merged / CARD).write_text(f"## Recipe\n\n```yaml\n{text.rstrip()}\n```\n")
    with pytest.raises(NotGranted, match=r"model.allow_pickle is true.*--allow-pickle"):
        find_trained(merged)
    assert find_trained(merged, allow_pickle=True).recipe.model.allow_pickle


def test_evaluate_reads_the_run_recipe_with_the_callers_trust_and_code_only(evil, cache_dir, tmp_path):
    from lorakit.inference.model import find_trained
    from lorakit.inference.split_eval import evaluation_recipe

    model = {"name_or_path": "tiny:t5", "dtype": "float32", "trust_remote_code": True}
    run = _run_dir(tmp_path, cache_dir, model=model, data=TRANSFORM["data"])
    trained = find_trained(run, trust_remote_code=True)
    # Before: the run directory's trust_remote_code reached the model loader of lorakit.evaluate.
    with pytest.raises(NotGranted, match=r"model.trust_remote_code is true.*--trust-remote-code"):
        evaluation_recipe(trained, None, ())
    # The data is read: its transform is code the caller must name.
    with pytest.raises(NotGranted, match=r"data.transform .*evil_code:transform.* --allow-code evil_code"):
        evaluation_recipe(trained, None, (), trust_remote_code=True)
    recipe = evaluation_recipe(trained, None, (), trust_remote_code=True, allow_code=["evil_code"])
    assert recipe.model.trust_remote_code and recipe.data.transform == "evil_code:transform"
    assert not evil.exists()  # imported where the data is read, not by reading the recipe


def test_push_reads_a_run_recipe_as_data(evil, cache_dir, tmp_path):
    from lorakit.export.publish import _run_recipe

    run = _run_dir(tmp_path, cache_dir, train=PLUGIN["train"], data=TRANSFORM["data"])
    recipe, text = _run_recipe(run)
    assert recipe is None and "evil_code" in text  # the card says less; nothing ran
    run2 = tmp_path / "run2"
    run2.mkdir()
    raw = tiny_recipe_dict(cache_dir, run2, data=TRANSFORM["data"])
    raw["model"]["trust_remote_code"] = True
    (run2 / rundir.RECIPE).write_text(yaml.safe_dump(raw))
    recipe, _ = _run_recipe(run2)
    assert recipe.model.trust_remote_code  # for the card's record: push loads no model
    assert not evil.exists()


@pytest.mark.slow  # runs each CLI in a fresh interpreter
@pytest.mark.parametrize("module", ["lorakit.merge", "lorakit.generate", "lorakit.evaluate"])
def test_the_clis_refuse_with_exit_2_naming_the_field_and_the_flag(module, cache_dir, tmp_path):
    """`python -m` puts the working directory on the import path: a run directory's recipe naming a module
    there must not import it."""
    run = _run_dir(tmp_path, cache_dir, train=PLUGIN["train"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "evil_code.py").write_text(EVIL)
    mark = tmp_path / "imported"
    extra = {"lorakit.merge": ["--output", str(tmp_path / "out")], "lorakit.generate": ["--input", "-"]}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAKIT_TEST_MARK": str(mark)}
    out = subprocess.run(
        [sys.executable, "-m", module, str(run), *extra.get(module, [])],
        cwd=cwd, env=env, input="", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.objective_module" in out.stderr and "--allow-code evil_code" in out.stderr
    assert "Traceback" not in out.stderr and not mark.exists()


def test_a_deep_recipe_read_back_is_refused_in_one_line_by_every_reader(cache_dir, tmp_path):
    """Class 5 where a recipe is read back: merge/generate (locate), evaluate, push (its public copy)."""
    from lorakit.errors import LorakitError
    from lorakit.export.public import public_recipe
    from lorakit.export.sources import locate
    from lorakit.inference.model import find_trained
    from lorakit.inference.split_eval import evaluation_recipe

    run = _run_dir(tmp_path, cache_dir)
    good = find_trained(run)
    deep = "data:\n  source: " + "[" * 20000 + "]" * 20000 + "\n"
    (run / rundir.RECIPE).write_text(deep)
    for read in (lambda: locate(run), lambda: evaluation_recipe(good, None, ()), lambda: public_recipe(deep)):
        with pytest.raises(LorakitError) as err:
            read()
        assert "nested more than 64 levels deep" in str(err.value) and "\n" not in str(err.value)
