"""A merge of a run directory holds the run's lock, so it never reads what a training run still writes."""

from __future__ import annotations

import pytest

from lorakit import rundir
from lorakit.errors import RunLockedError
from lorakit.export import merge
from lorakit.runlock import LOCK, RunLock


def test_a_merge_waits_for_no_one_it_is_refused_while_a_run_holds_the_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.RECIPE).write_text("not: a recipe\n")
    with RunLock(run), pytest.raises(RunLockedError, match="in use by another run"):
        merge(run / "adapter", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # Free again: the merge takes the lock, fails on the bad recipe, and gives the lock back.
    with pytest.raises(Exception) as failed:
        merge(run, tmp_path / "out")
    assert not isinstance(failed.value, RunLockedError)
    assert not (run / LOCK).exists()
