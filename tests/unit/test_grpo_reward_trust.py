"""grpo.rewards naming `module:function` is code (recipe/read_back.py CODE_FIELDS): a recipe read back from a
run directory that reads its data is refused unless the caller names the module, and nothing is imported.
grpo.vllm_server is a server the run sends the adapter and the prompts to: a run directory's recipe.yaml
(a resumed run) names one the run contacts only when the caller confirms it (--allow-server URL, or the field
set on the command line); otherwise one line, exit code 2, nothing written."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import yaml

from lorakit.recipe.read_back import NotGranted, check_servers, named_code, named_servers, read_back_recipe

RAW = {
    "train": {"objective": "grpo"},
    "grpo": {"rewards": [{"name": "exact_match"}, {"name": "lk_evil_rewards:score", "weight": 2}]},
}


def test_reward_functions_are_named_code_and_built_ins_are_not():
    assert named_code(RAW) == {"grpo.rewards[1].name": "lk_evil_rewards:score"}


def test_a_read_back_recipe_reading_data_must_be_granted_its_reward_module():
    text = yaml.safe_dump(RAW)
    with pytest.raises(
        NotGranted, match=r"grpo.rewards\[1\].name .*lk_evil_rewards:score.* --allow-code lk_evil"
    ):
        read_back_recipe(text, "run/recipe.yaml", reads_data=True)
    assert "lk_evil_rewards" not in sys.modules


URL = "http://gen.example:8000"


def test_only_the_caller_confirms_a_server_a_read_back_recipe_names():
    served = {"train": {"objective": "grpo"}, "grpo": {"rollout_engine": "vllm", "vllm_server": URL}}
    assert named_servers(served) == {"grpo.vllm_server": URL} and named_servers(RAW) == {}
    with pytest.raises(
        NotGranted,
        match=rf"grpo.vllm_server names a server .*'{URL}'.* --allow-server {URL} if you trust it$",
    ):
        check_servers(served, "run/recipe.yaml", allow_server=())
    with pytest.raises(NotGranted):
        check_servers(served, "run/recipe.yaml", allow_server=["http://other:8000"])
    check_servers(served, "run/recipe.yaml", allow_server=[URL])  # --allow-server URL
    check_servers(served, "run/recipe.yaml", allow_server=(), given={"grpo.vllm_server"})  # the override
    check_servers(RAW, "run/recipe.yaml", allow_server=())  # no server: nothing to confirm


def test_resuming_a_run_directorys_recipe_that_names_a_server_is_refused_before_anything_runs(
    tmp_path, capsys
):
    from lorakit import rundir
    from lorakit.recipe import dump_recipe, load_recipe
    from lorakit.run import _check_servers, main
    from tests.conftest import RECIPES

    raw = yaml.safe_load((RECIPES / "quickstart_grpo.yaml").read_text())
    raw["grpo"] |= {"rollout_engine": "vllm", "vllm_server": URL}
    run = tmp_path / "sent_run"
    raw["output"]["dir"] = str(run)
    run.mkdir()
    rundir.mark(run)
    # The run's own resolved recipe.yaml, as a run writes it (relaunching it resumes the run).
    (tmp_path / "given.yaml").write_text(yaml.safe_dump(raw))
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(tmp_path / "given.yaml")))
    before = sorted(p.name for p in run.iterdir())
    assert main([str(run / "recipe.yaml")]) == 2
    # One line of error (and the usual pointer to the field's documentation).
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and err[1:] == ["see docs/recipes.md#grpo"], err
    assert "grpo.vllm_server" in err[0] and err[0].endswith(f"--allow-server {URL} if you trust it")
    assert sorted(p.name for p in run.iterdir()) == before
    # Confirmed (the flag, or the field set on the command line), or a recipe file of the caller's own
    # outside any run directory: the run goes on past the check.
    recipe = load_recipe(run / "recipe.yaml")
    for path, allow, overrides in [
        (run / "recipe.yaml", [URL], []),
        (run / "recipe.yaml", [], [f"grpo.vllm_server={URL}"]),
        (tmp_path / "mine.yaml", [], []),
    ]:
        args = SimpleNamespace(recipe=str(path), allow_server=allow, overrides=overrides)
        assert _check_servers(args, recipe) is None
