"""Bad input that can be known before a run starts (model directory, tokenizer, data files and columns) is
exit 2 naming the file or field, in the launching process: no worker starts and no run directory is made
(issue 44; README: "before anything is written")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import lorakit
from lorakit.errors import LorakitError
from lorakit.run import main as run_main
from lorakit.testing import resolve_model_source
from tests.conftest import RECIPES, tiny_recipe


@pytest.fixture(scope="module")
def tiny_t5(cache_dir) -> Path:
    return Path(resolve_model_source("tiny:t5", cache_dir))


def _broken(tiny_t5: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the tiny T5's directory, broken as `how` says."""
    model = tmp_path / "model"
    shutil.copytree(tiny_t5, model)
    if how == "no config":
        (model / "config.json").unlink()
    elif how == "a shard missing":
        weights = load_file(model / "model.safetensors")
        (model / "model.safetensors").unlink()
        names = sorted(weights)
        shards = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
        save_file(
            {n: weights[n] for n in names if shards[n].startswith("model-00001")}, model / shards[names[0]]
        )
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": shards})
        )
    elif how == "no tokenizer":
        (model / "tokenizer.json").unlink()
    elif how == "no eos or pad":
        config = json.loads((model / "tokenizer_config.json").read_text())
        for key in ("eos_token", "pad_token"):
            config.pop(key, None)
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


MODEL_CASES = {
    "no config": "{model}/config.json is missing",
    "a shard missing": "{model}/model-00002-of-00002.safetensors is missing",
    "no tokenizer": "{model} holds no tokenizer (none of tokenizer.json,",
    "no eos or pad": "its tokenizer has neither a pad token nor an eos token",
}


@pytest.mark.parametrize("how", MODEL_CASES)
def test_an_incomplete_model_directory_is_named_before_anything_starts(
    how, tiny_t5, cache_dir, tmp_path, capsys
):
    model = _broken(tiny_t5, tmp_path, how)
    message = f"model.name_or_path '{model}': " + MODEL_CASES[how].format(model=model)
    run_dir = tmp_path / "run"
    # One process (lorakit.train trains in this process): refused before the run lock makes output.dir.
    recipe = tiny_recipe(cache_dir, run_dir, model={"name_or_path": str(model)}, output={"report_to": []})
    with pytest.raises(LorakitError) as err:
        lorakit.train(recipe)
    assert err.value.exit_code == 2 and message in str(err.value)
    assert not run_dir.exists()
    # The quickstart's 2 processes through the CLI: refused before torchrun starts a worker.
    overrides = [f"model.name_or_path={model}", f"data.cache_dir={cache_dir}", f"output.dir={run_dir}"]
    code = run_main([str(RECIPES / "quickstart.yaml"), *overrides, "output.report_to=[]"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {message}" in err and "Traceback" not in err, err
    assert not run_dir.exists()


def test_a_missing_data_file_or_column_leaves_no_run_directory(cache_dir, tmp_path, capsys):
    # One process: the job itself used to find these, after the run lock had made output.dir, and leave it
    # holding exit.json.
    common = [f"data.cache_dir={cache_dir}", "distributed.num_processes=1", "output.report_to=[]"]
    for overrides, message in (
        (["data.target_column=summary"], "error: data.target_column: column 'summary' not found"),
        ([f"data.source={tmp_path / 'nope.jsonl'}"], f"data.source: no such file or directory: {tmp_path}"),
    ):
        run_dir = tmp_path / "run"
        code = run_main([str(RECIPES / "quickstart.yaml"), *common, *overrides, f"output.dir={run_dir}"])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
        assert not run_dir.exists()
