"""A rank that lorakit.train launched freezes its imported heap (lorakit.run.freeze_imported_heap); the launcher
and lorakit.train called in a person's own process never do (their later garbage would never be collected)."""

from __future__ import annotations

import gc
import sys
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import tiny_recipe_dict


@pytest.fixture
def thawed():
    """No frozen objects while the test runs (the suite's conftest freezes what collection imported), frozen
    again afterwards."""
    gc.unfreeze()
    yield
    gc.freeze()


def _main_seeing_freeze_count(monkeypatch, tmp_path, *flags: str) -> int:
    """Run lorakit.run's main on a tiny recipe with `flags`, lorakit.train replaced by a probe: how many
    objects were frozen when the job would have started."""
    import lorakit.run

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tmp_path / "cache", tmp_path / "run")))
    seen = []

    def probe(recipe):
        seen.append(gc.get_freeze_count())
        return SimpleNamespace(already_complete=False)

    monkeypatch.setattr(lorakit, "train", probe)
    monkeypatch.setattr(lorakit.run, "report_lines", lambda result: [])
    assert lorakit.run.main([str(recipe), *flags]) == 0
    return seen[0]


def test_a_launched_rank_freezes_what_it_imported_before_the_job(thawed, monkeypatch, tmp_path):
    # Failure caught: the freeze dropped or moved after the job's start (every full collection of the rank
    # walks the libraries again: DeepSpeed's ZeRO-3 setup, the group teardown, the memory probe).
    frozen = _main_seeing_freeze_count(monkeypatch, tmp_path, "--worker")
    assert frozen > 100_000  # the training stack's objects: about 700k with torch, transformers, DeepSpeed
    assert "lorakit.engine.job" in sys.modules


def test_the_launcher_and_lorakit_train_in_a_persons_process_freeze_nothing(thawed, monkeypatch, tmp_path):
    # Failure caught: a freeze outside a launched rank (the launcher, or a notebook's lorakit.train through
    # the same entry), where objects alive then and dropped later would never be collected.
    assert _main_seeing_freeze_count(monkeypatch, tmp_path) == 0
