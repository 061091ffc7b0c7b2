"""distributed.timeout_minutes reaches the process group: a collective that waits longer fails; the phase and
recorders of dist.py belong to the job that set them."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as torch_dist

from lorakit import dist
from lorakit.engine.launch import process_group
from lorakit.recipe.schema import DistributedSection


def test_the_group_gets_the_recipes_timeout():
    assert DistributedSection().timeout_minutes == 30
    with process_group("gloo", 0.5):
        backend = torch_dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=30)
        # One process: the agreements are plain calls.
        assert dist.on_main("eval write", lambda: {"loss": 1.0}, share=True) == {"loss": 1.0}
        assert dist.on_every_rank("load", lambda x: x + 1, 1) == 2


def test_a_jobs_phase_and_recorders_end_with_it():
    """The phase and the failure recorders are held by the running job's Coordination, not the process: once
    its block ends, a second job in the same process starts at start-up with nobody recording."""
    seen = []
    with dist.recording_failures(seen.append), dist.phase("training", 3):
        assert dist.where() == "training at step 3"
        with pytest.raises(RuntimeError, match="disk on fire"):
            dist.on_every_rank("checkpoint save", _fail)
    assert [str(e) for e in seen] == ["disk on fire"]
    assert dist.where() == "start-up"
    with dist.coordination() as second:
        assert second.recorders == [] and dist.where() == "start-up"


def _fail():
    raise RuntimeError("disk on fire")
