"""A full disk under data.cache_dir: exit 74 and one line naming the cache, no datasets traceback, no
partial cache entry."""

from __future__ import annotations

import errno

import datasets
import yaml

from lorakit.api import prepare
from lorakit.cli import run_cli
from lorakit.recipe import load_recipe
from tests.conftest import tiny_recipe_dict


def test_no_space_in_the_datasets_cache_is_exit_74_with_one_line(cache_dir, tmp_path, monkeypatch, capsys):
    # A sample count no other test uses: a cache entry this test must write (the tiny model is cached).
    raw = tiny_recipe_dict(cache_dir, tmp_path / "run", data={"max_samples": 13})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    datasets_dir = cache_dir / "datasets"
    before = set(datasets_dir.iterdir()) if datasets_dir.exists() else set()

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    # What `python -m lorakit.prepare` (and the launcher of a multi-process run) does with it.
    assert run_cli(lambda: prepare(load_recipe(str(recipe))) and None) == 74
    err = capsys.readouterr().err
    # (datasets' progress bars come first here; the CLIs turn them off)
    lines = err.strip().splitlines()[-2:]
    assert lines[0].startswith("error: no space left on the device while writing the tokenized data cache")
    assert lines[1] == "see docs/resume.md#a-full-disk"
    assert "Traceback" not in err
    assert set(datasets_dir.iterdir()) == before
