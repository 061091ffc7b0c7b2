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


_STUCK_PEER = """
import os, sys, time
import torch.distributed as td
from lorakit import dist
td.init_process_group("gloo")
try:
    with dist.phase("checkpoint save", 2), dist.foreign_collectives(give_up=1.0):
        if dist.rank() == 1:
            raise RuntimeError("cannot write to https://user:pw@host/ckpt")
        time.sleep(60)  # as a peer waits in NCCL's barrier after the failing rank left: no error comes
except Exception as e:
    print(f"raised {type(e).__name__}: {e}", flush=True)
    os._exit(3)
"""


@pytest.mark.slow  # launches an interpreter
def test_a_rank_stuck_in_a_library_collective_hears_the_failure_and_ends():
    """dist.foreign_collectives on 2 plain processes: rank 1 fails inside the block and leaves its line in the
    group's store; rank 0, waiting where no error would ever come (NCCL's barrier), reads it and ends within
    `give_up` with that line (credentials redacted) and exit code 1, not after distributed.timeout_minutes."""
    import os
    import subprocess
    import sys
    import time

    from lorakit.engine.launch import free_port
    from tests.conftest import ROOT

    port = str(free_port())
    procs = []
    start = time.monotonic()
    for r in (0, 1):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        env |= {"MASTER_PORT": port, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", _STUCK_PEER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    (out0, err0), (out1, _) = (p.communicate(timeout=60) for p in procs)
    assert time.monotonic() - start < 30
    assert [p.returncode for p in procs] == [1, 3]
    assert out1.strip() == "raised RuntimeError: cannot write to https://user:pw@host/ckpt"
    cause = "rank 1 failed during checkpoint save at step 2: RuntimeError: cannot write to https://user:***@host/ckpt"
    assert err0.strip().splitlines()[-1] == f"error: {cause}; rank 0 stopped with it", err0
    assert out0 == ""
