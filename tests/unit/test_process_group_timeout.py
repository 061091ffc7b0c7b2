"""distributed.timeout_minutes reaches the process group: a collective that waits longer fails."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as torch_dist

from lorakit.engine import dist
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
