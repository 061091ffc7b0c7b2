"""Checks before a run: output.dir and data.cache_dir must be (or become) writable directories with room
for what the run writes; the estimate comes from the model config's parameter census."""

import os

import pytest

from lorakit import preflight
from lorakit.errors import RunDirError
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict
from tests.disk_faults import installed


def _recipe(tmp_path, out=None, cache=None, **sections):
    raw = tiny_recipe_dict(cache or tmp_path / "cache", out or tmp_path / "run", **sections)
    return recipe_from_dict(raw)


def test_missing_directories_pass_and_nothing_is_created(tmp_path):
    recipe = _recipe(tmp_path, out=tmp_path / "runs" / "a", cache=tmp_path / "c" / "d")
    need = preflight.check_run_paths(recipe)
    assert need is not None and need.total > need.saved > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(RunDirError) as e:
        preflight.check_run_paths(_recipe(tmp_path))
    assert f"output.dir {tmp_path / 'run'} exists and is not a directory" in str(e.value)
    assert e.value.exit_code == 2 and e.value.doc_link() == "docs/resume.md#checks-before-the-run"


def test_a_file_in_the_way_of_a_directory_to_create(tmp_path):
    (tmp_path / "cache").write_text("")
    with pytest.raises(
        RunDirError, match=rf"data\.cache_dir {tmp_path}/cache/sub cannot be created: .* is a file"
    ):
        preflight.check_run_paths(_recipe(tmp_path, cache=tmp_path / "cache" / "sub"))


@pytest.mark.parametrize("exists", [True, False], ids=["existing", "to-create"])
def test_read_only_output_dir(tmp_path, exists):
    out = tmp_path / "ro" / "run"
    (out if exists else out.parent).mkdir(parents=True)
    with installed("readonly", f"{tmp_path}/ro*"), pytest.raises(RunDirError) as e:
        preflight.check_run_paths(_recipe(tmp_path, out=out))
    assert "output.dir" in str(e.value) and "read-only filesystem" in str(e.value)
    assert str(out) in str(e.value)
    assert not list(out.parent.glob(".lorakit-write-test-*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_unwritable_output_dir_by_permissions(tmp_path):
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o555)
    try:
        with pytest.raises(RunDirError, match="permission denied"):
            preflight.check_run_paths(_recipe(tmp_path))
    finally:
        os.chmod(tmp_path / "run", 0o755)


def test_full_filesystem(tmp_path):
    with installed("disk-full", f"{tmp_path}*"), pytest.raises(RunDirError) as e:
        preflight.check_run_paths(_recipe(tmp_path))
    message = str(e.value)
    # One filesystem for both: what each needs is named, and the free space they share.
    assert message.startswith("not enough free space: output.dir ")
    assert f"output.dir {tmp_path / 'run'} needs about" in message
    assert "the adapter" in message and "one checkpoint" in message
    assert f"data.cache_dir {tmp_path / 'cache'} needs about 64.00 MiB" in message
    assert "the filesystem they share has 0 B free" in message


def test_estimates_follow_the_method_and_merge(tmp_path):
    lora = preflight.estimate_space(_recipe(tmp_path))
    full = preflight.estimate_space(_recipe(tmp_path, method={"kind": "full"}))
    merged = preflight.estimate_space(_recipe(tmp_path, output={"dir": str(tmp_path / "r"), "merge": True}))
    assert lora.saved < full.saved and lora.checkpoint < full.checkpoint
    assert full.saved_name == "the model" and lora.merged == 0 and merged.merged == full.saved
    # fp32 weights + fp32 master weights + two Adam moments per trainable parameter (tiny recipe: float32).
    assert full.checkpoint == full.saved // 4 * 16


def test_known_hub_models_are_estimated_offline(tmp_path):
    need = preflight.estimate_space(
        _recipe(
            tmp_path,
            model={"name_or_path": "google/flan-t5-xxl", "dtype": "bfloat16"},
            method={"kind": "full"},
        )
    )
    # FLAN-T5 XXL: 11.1 B parameters, 2 bytes each saved, 14 per parameter in a checkpoint.
    assert 21e9 < need.saved < 23e9 and 150e9 < need.checkpoint < 160e9


def test_unknown_models_get_no_estimate_and_only_the_margin(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = _recipe(tmp_path, model={"name_or_path": "nobody/no-such-model-xyz"})
    assert preflight.estimate_space(recipe) is None
    assert preflight.check_run_paths(recipe) is None


def test_the_cache_check_alone(tmp_path):
    (tmp_path / "cache").write_text("")
    with pytest.raises(RunDirError, match="data.cache_dir"):
        preflight.check_cache_dir(_recipe(tmp_path))
