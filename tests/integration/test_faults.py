"""No hang, ever (docs/faults.md): a failure on any rank ends every rank quickly, with one root cause.

The agreement rows run in a light 2-process gloo group (fault_harness_worker.py, no DeepSpeed, no model),
started as plain processes the way srun or pdsh start them; the rows that need the real job run the tiny
T5 on 2 processes under lorakit's launcher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from lorakit.engine.launch import free_port
from tests.conftest import ROOT
from tests.integration.fault_harness_worker import FAULT_ROWS
from tests.process_groups import finish_group, start_group

WORKER = Path(__file__).with_name("fault_harness_worker.py")


def _harness(mode: str, out: Path, timeout: float = 60) -> tuple[list[list], list[list], list[int], float]:
    """Run the harness on 2 plain processes; returns each rank's rows, their exit codes and the seconds
    until both were gone."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    start = time.monotonic()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=port, LOCAL_RANK=str(rank), PYTHONPATH=str(ROOT))
        procs.append(start_group([sys.executable, str(WORKER), mode, str(out)], env, ROOT, merge_stderr=True))
    done = [finish_group(p, timeout) for p in procs]
    seconds = time.monotonic() - start
    rows = [
        json.loads(p.read_text()) if p.exists() else [] for p in (out / "rank-0.json", out / "rank-1.json")
    ]
    return rows[0], rows[1], [d.returncode for d in done], seconds


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    return _harness("agree", tmp_path_factory.mktemp("agree"))


@pytest.mark.parametrize("row", range(len(FAULT_ROWS)), ids=[f"{n}-rank{r}-{s}" for n, r, s in FAULT_ROWS])
def test_an_error_on_one_rank_stops_every_rank_at_the_agreement(agreement, row):
    rank0, rank1, codes, seconds = agreement
    name, failing, _ = FAULT_ROWS[row]
    assert codes == [0, 0] and seconds < 60
    step = row + 1
    for rank, rows in ((0, rank0), (1, rank1)):
        got_name, got_failing, kind, message, took = rows[row]
        assert (got_name, got_failing) == (name, failing)
        assert took < 10
        if rank == failing:
            # The failing rank raises its own error, the root cause.
            assert (kind, message) == ("Injected", f"injected in {name}")
        else:
            # The others learn it at the agreement: one line naming the rank, the phase, the step, the error.
            assert kind == "RankFailedError"
            assert message == (
                f"rank {failing} failed during {name} at step {step}: Injected: injected in {name}; "
                f"rank {rank} stopped with it"
            )
    # No rank was left in a collective: the group still works after every row.
    assert rank0[-1][2:4] == rank1[-1][2:4] == ["ok", "2.0"]


def test_a_rank_that_dies_mid_step_ends_the_others_with_the_phase_and_step(tmp_path):
    rank0, rank1, codes, seconds = _harness("crash", tmp_path)
    assert codes == [0, 1] and seconds < 60 and rank1 == []
    kind, message = rank0[0][2:4]
    assert kind == "CollectiveTimeoutError"
    assert message.startswith("rank 0 stopped during training at step 1: a collective did not complete")


def test_a_stalled_rank_is_an_error_after_the_group_timeout(tmp_path):
    rank0, _, codes, seconds = _harness("stall", tmp_path)
    kind, message, took = rank0[0][2:5]
    assert kind == "CollectiveTimeoutError"
    assert message.startswith("rank 0 stopped during training at step 1: a collective did not complete")
    assert "distributed.timeout_minutes" in message
    # The group's timeout is 3 s; rank 1 stalls for 6.
    assert 2.5 < took < 5.9
