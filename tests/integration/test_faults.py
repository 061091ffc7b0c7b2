"""No hang, ever (docs/faults.md): a failure on any rank ends every rank quickly, with one root cause.

The agreement rows run in a light 2-process gloo group (fault_harness_worker.py, no DeepSpeed, no model),
started as plain processes the way srun or pdsh start them; the rows that need the real job run the tiny
T5 on 2 processes under lorakit's launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.engine.launch import free_port
from tests.conftest import ROOT, tiny_recipe_dict
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


@pytest.mark.parametrize(("mode", "failing", "code"), [("raise", 0, 1), ("raise", 1, 1), ("kill", 1, -9)])
def test_a_rank_that_dies_mid_step_ends_the_other_with_the_phase_and_step(tmp_path, mode, failing, code):
    rows = _harness(f"{mode}-{failing}", tmp_path)
    codes, seconds = rows[2], rows[3]
    other = 1 - failing
    assert codes[failing] == code and codes[other] == 0 and seconds < 60 and rows[failing] == []
    kind, message = rows[other][0][2:4]
    assert kind == "CollectiveTimeoutError"
    assert message.startswith(
        f"rank {other} stopped during training at step 1: a collective did not complete"
    )


def test_a_stalled_rank_is_an_error_after_the_group_timeout(tmp_path):
    rank0, _, codes, seconds = _harness("stall", tmp_path)
    kind, message, took = rank0[0][2:5]
    assert kind == "CollectiveTimeoutError"
    assert message.startswith("rank 0 stopped during training at step 1: a collective did not complete")
    assert "distributed.timeout_minutes" in message
    # The group's timeout is 3 s; rank 1 stalls for 6.
    assert 2.5 < took < 5.9


FAULTS = Path(__file__).parent / "faults"


def _run_recipe(cache_dir: Path, out: Path, path: Path, **output) -> Path:
    raw = tiny_recipe_dict(
        cache_dir,
        out,
        train={"max_steps": 3, "micro_batch_size": 4},
        distributed={"num_processes": 2, "zero_stage": 0},
        eval={"enabled": False},
        checkpoint={"every": 1, "keep": 3},
        output=output,
    )
    path.write_text(yaml.safe_dump(raw))
    return path


def _launch(recipe: Path, **env: str) -> tuple[subprocess.CompletedProcess, float, bool]:
    """`python -m lorakit.run RECIPE` with faults/sitecustomize.py; returns its result, the time it ended,
    and whether every process of its session (workers, torchrun, tracker helpers) was gone 10 s later."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("LORAKIT_", "WANDB_", "MLFLOW_"))}
    full |= env | {"PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = start_group([sys.executable, "-m", "lorakit.run", str(recipe)], full, ROOT)
    done = finish_group(proc, 600)
    ended = time.time()
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return done, ended, True
        time.sleep(0.1)
    return done, ended, False


@pytest.mark.slow
def test_a_failed_checkpoint_part_ends_the_run_and_a_resume_survives_dead_trackers(cache_dir, tmp_path):
    run = tmp_path / "run"
    stamp = tmp_path / "failed-at"
    recipe = _run_recipe(cache_dir, run, tmp_path / "recipe.yaml", report_to=[])
    # Rank 1 fails writing its part of step 2's checkpoint; rank 0 wrote its own part.
    failed, ended, gone = _launch(recipe, LORAKIT_RAISE="checkpoint save@1:2", LORAKIT_FAULT_STAMP=str(stamp))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert gone and ended - float(stamp.read_text()) < 60
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    root_cause = "rank 1 failed during checkpoint save at step 2: RuntimeError: injected in checkpoint save"
    assert lines[-2:] == [f"error: {root_cause}", "see docs/faults.md#what-a-failed-rank-does"]
    assert failed.stderr.count(root_cause) <= 3  # the launcher's line, rank 1's traceback, rank 0's line
    # No rank removed what another was writing; the previous checkpoint is complete, nothing half-written.
    assert [c.step for c in complete_checkpoints(run)] == [1]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]

    # The relaunch resumes from it, with MLflow and W&B servers that are down (closed local ports) and a
    # TensorBoard that fails every write: training completes, summary.json says which trackers failed.
    closed = f"http://127.0.0.1:{free_port()}"
    trackers = ["tensorboard", "mlflow", "wandb"]
    recipe = _run_recipe(cache_dir, run, recipe, report_to=trackers, tracker_timeout_seconds=5)
    resumed, _, gone = _launch(
        recipe,
        LORAKIT_RAISE="tracker log@0",
        MLFLOW_TRACKING_URI=closed,
        WANDB_MODE="online",
        WANDB_BASE_URL=closed,
        WANDB_API_KEY="x" * 40,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert gone
    summary = rundir.read_summary(run)
    assert summary["resumed_from"]["step"] == 1 and summary["steps"] == 3
    assert summary["trackers"]["tensorboard"]["failed"] == "RuntimeError: injected in tracker log"
    for backend in ("mlflow", "wandb"):
        assert summary["trackers"][backend]["failed"], summary["trackers"]
        assert resumed.stderr.count(f"tracker {backend} ") == 1
    assert [r["step"] for r in rundir.read_metrics(run) if r["kind"] == "train"] == [1, 2, 3]
