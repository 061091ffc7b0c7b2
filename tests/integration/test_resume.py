"""Resume exactly, survive preemption and crashes: 2 processes, ZeRO-3, real launches of `python -m
lorakit.run` (which runs torchrun), with faults injected by tests/integration/faults/sitecustomize.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.engine.launch import free_port
from lorakit.runlock import LOCK, read_holder
from tests.conftest import ROOT, tiny_recipe_dict
from tests.process_groups import finish_group, start_group

FAULTS = Path(__file__).parent / "faults"
STEPS = 8


def _recipe(cache_dir: Path, out: Path, path: Path) -> Path:
    raw = tiny_recipe_dict(
        cache_dir,
        out,
        # Dropout on: a resume must restore the RNG streams, not only the weights.
        method={"dropout": 0.1},
        train={"max_steps": STEPS, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
        distributed={"num_processes": 2, "zero_stage": 3},
        eval={"enabled": False},
        checkpoint={"every": 2, "keep": 2},
        # No tracker until the last relaunch of the chain below turns them on (and makes them fail).
        output={"report_to": []},
    )
    path.write_text(yaml.safe_dump(raw))
    return path


def _start(recipe: Path, fault: str | None = None, **extra_env: str) -> subprocess.Popen:
    """Start `python -m lorakit.run RECIPE`; `fault` and `extra_env` reach every process through
    faults/sitecustomize.py."""
    # Only the trackers the test sets up: none of the caller's W&B or MLflow settings.
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "LORAKIT_FAULT" and not k.startswith(("WANDB_", "MLFLOW_"))
    }
    env |= extra_env
    if fault:
        env["LORAKIT_FAULT"] = fault
    if fault or extra_env:
        env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), str(ROOT), env.get("PYTHONPATH", "")])
    return start_group([sys.executable, "-m", "lorakit.run", str(recipe)], env, ROOT)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    return finish_group(proc, timeout)


def launch(recipe: Path, fault: str | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    """`python -m lorakit.run RECIPE` to the end; see _start."""
    return _finish(_start(recipe, fault, **extra_env))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rundir.read_metrics(run_dir) if r["kind"] == "train"}


def _adapter(run_dir: Path):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_run(run_dir: Path, reference: Path, steps: int = STEPS) -> None:
    """A resumed run equals the uninterrupted `reference`: its metrics.jsonl reads as one run (every step of
    `steps` once, the same losses) and its adapter is the same."""
    assert _losses(run_dir) == pytest.approx(_losses(reference), abs=1e-6)
    assert sorted(_losses(run_dir)) == list(range(1, steps + 1))
    a, b = _adapter(run_dir), _adapter(reference)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(_recipe(cache_dir, base / "run", base / "recipe.yaml"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return base / "run"


def _resumed_from(proc: subprocess.CompletedProcess, run_dir: Path, step: int) -> bool:
    """Whether the launch `proc` said it resumed from `run_dir`'s checkpoint of `step`."""
    ckpt = (run_dir / "checkpoints" / f"step-{step:08d}").resolve()
    return f"resuming from {ckpt} " in proc.stdout + proc.stderr


def _gone_soon(proc: subprocess.Popen) -> bool:
    """Whether every process of `proc`'s session (workers, torchrun, tracker helpers) is gone within 10 s."""
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _ends_with(proc: subprocess.CompletedProcess, line: str) -> None:
    """The launcher's last two lines: `line`, the root cause, and where docs/faults.md explains it."""
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines[-2:] == [line, "see docs/faults.md#a-rank-that-dies"], proc.stderr[-5000:]


@pytest.mark.slow
def test_a_run_refused_killed_crashed_out_of_space_and_preempted_resumes_like_uninterrupted(
    reference, cache_dir, tmp_path
):
    """One run through the faults of a node, a rank, a disk and a scheduler, each launch going on from what
    the previous one left (one run for all of them keeps the suite's launches few):
    1. Two launches of one recipe at once: exactly one trains, the other exits 2 within seconds naming it.
    2. The first is SIGKILLed mid-epoch (after step 5): no summary, checkpoints 2 and 4, its lock behind.
    3. A relaunch takes the stale lock over, resumes from step 4, and its rank 1 is SIGKILLed (as the
       out-of-memory killer does) as step 6 starts: the launcher names the rank that died and how, not the
       survivor's collective, exit 1, every process gone within seconds.
    4. The next relaunch's rank 0 dies while writing step 6's checkpoint (exit 1, steps 2 and 4 kept, the
       half-written directory removed); the one after runs out of space writing it (exit 74, the lock
       released).
    5. The next one is preempted (SIGTERM after its second step, 6): exit 75, a preempted checkpoint, the
       lock released.
    6. The last one resumes from that checkpoint with MLflow and W&B servers that are down (closed local
       ports) and a TensorBoard that fails every write, and ends as the uninterrupted run did; summary.json
       says which trackers failed. (docs/faults.md calls this chain `killed`.)"""
    run = tmp_path / "run"
    recipe = _recipe(cache_dir, run, tmp_path / "recipe.yaml")
    root = run / "checkpoints"
    go = tmp_path / "go"
    first = _start(recipe, fault="kill:5", LORAKIT_HOLD_UNTIL=str(go))
    try:
        # The first launch is training (its rank 0 waits before step 1 until told to go on).
        deadline = time.monotonic() + 600
        while not Path(f"{go}.waiting").exists():
            assert first.poll() is None and time.monotonic() < deadline, _finish(first, 1).stderr[-5000:]
            time.sleep(0.5)
        holder = read_holder(run / LOCK)
        assert holder.pid == first.pid

        start = time.monotonic()
        second = launch(recipe)
        seconds = time.monotonic() - start
        assert second.returncode == 2, second.stderr[-5000:]
        assert f"is in use by another run: pid {first.pid} on host {holder.host}" in second.stderr
        assert "Traceback" not in second.stderr and "batching:" not in second.stdout
        assert seconds < 60, seconds
        assert read_holder(run / LOCK).token == holder.token
    finally:
        go.touch()
        killed = _finish(first)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-5000:]
    assert not (run / "summary.json").exists()
    assert [c.step for c in complete_checkpoints(run)] == [2, 4]
    assert read_holder(run / LOCK).token == holder.token  # SIGKILL left it behind

    # Rank 1 is SIGKILLed as its second step (6) starts; rank 0 is then in that step's collectives.
    stamp = tmp_path / "killed-at"
    proc = _start(
        recipe, LORAKIT_RAISE="step@1:2", LORAKIT_RAISE_AS="SIGKILL", LORAKIT_FAULT_STAMP=str(stamp)
    )
    rank_killed = _finish(proc)
    ended = time.time()
    assert rank_killed.returncode == 1, rank_killed.stderr[-5000:]
    assert _gone_soon(proc) and ended - float(stamp.read_text()) < 60
    out = rank_killed.stdout + rank_killed.stderr
    assert f"run lock: taking over {run / LOCK} from pid {first.pid}" in out
    assert f"its process {first.pid} is gone" in out
    assert _resumed_from(rank_killed, run, 4)
    _ends_with(
        rank_killed,
        "error: rank 1 was killed by SIGKILL (signal 9) during training at step 6; rank 0 stopped with it",
    )
    assert "Traceback" not in rank_killed.stderr and "ChildFailedError" not in rank_killed.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004"]

    crashed = launch(recipe, fault="crash-save:6")
    assert crashed.returncode == 1, crashed.stderr[-5000:]
    assert _resumed_from(crashed, run, 4)
    # The launcher names the rank that ended without an error of its own, and where the run was.
    _ends_with(
        crashed,
        "error: rank 0 exited with code 9 (no error of its own) during checkpoint save at step 6; rank 1 "
        "stopped with it",
    )
    # Step 4 is intact and the newest; the half-written step 6 was never published, and the launcher removed
    # it once torchrun had stopped every worker (a launcher killed outright leaves it to the next save's prune).
    assert not (root / ".tmp-step-00000006").exists() and not (root / "step-00000006").exists()
    assert [c.step for c in complete_checkpoints(run)] == [2, 4]

    full = launch(recipe, fault="enospc:*/checkpoints/.tmp-step-00000006/*")
    assert _resumed_from(full, run, 4)
    # Rank 0 ran out of space in DeepSpeed's torch.save; the launcher exits with its code and message.
    assert full.returncode == 74, full.stderr[-5000:]
    assert (
        f"error: no space left on the device while writing the checkpoint of step 6 ({root / 'step-00000006'})"
        in full.stderr
    )
    assert [c.step for c in complete_checkpoints(run)] == [2, 4]
    assert not (root / "step-00000006").exists() and not (root / ".tmp-step-00000006").exists()
    assert not (run / LOCK).exists()

    # SIGTERM as the relaunch's second step (6) starts: the signal travels launcher -> torchrun -> workers
    # and the ranks stop together at the first boundary after it arrives: step 6, or a later one on a loaded
    # machine, never the end.
    stopped = launch(recipe, fault="term:2")
    assert stopped.returncode == 75, stopped.stderr[-5000:]
    assert _resumed_from(stopped, run, 4)
    assert "relaunch the same command to resume" in stopped.stderr.lower()
    # The console ends with lorakit's one line (and its doc pointer), said once for every rank: no traceback
    # from torchrun's agent (SignalException), none of its "death signal" / "closing signal" warnings, no
    # rank repeating it.
    assert "Traceback" not in stopped.stderr, stopped.stderr[-5000:]
    assert "death signal" not in stopped.stderr and "closing signal" not in stopped.stderr, stopped.stderr[
        -5000:
    ]
    assert stopped.stderr.count("stopped at step") == 1, stopped.stderr[-5000:]
    last = stopped.stderr.strip().splitlines()[-2:]
    assert (
        last[0].startswith("error: stopped at step ")
        and last[1] == "see docs/resume.md#preemption-sigterm-and-sigusr1"
    )
    ckpts = complete_checkpoints(run)
    stopped_at = ckpts[-1].step
    assert 6 <= stopped_at < STEPS and ckpts[-1].state["reason"] == "preempted"
    # Preemption released the run lock: a requeued job starts at once.
    assert not (run / LOCK).exists()

    # The last relaunch, with trackers that fail: training completes without them.
    closed = f"http://127.0.0.1:{free_port()}"
    trackers = ["tensorboard", "mlflow", "wandb"]
    raw = yaml.safe_load(recipe.read_text())
    raw["output"] |= {"report_to": trackers, "tracker_timeout_seconds": 5}
    recipe.write_text(yaml.safe_dump(raw))
    resumed = launch(
        recipe,
        LORAKIT_RAISE="tracker log@0",
        MLFLOW_TRACKING_URI=closed,
        WANDB_MODE="online",
        WANDB_BASE_URL=closed,
        WANDB_API_KEY="x" * 40,
    )
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert _resumed_from(resumed, run, stopped_at)
    summary = rundir.read_summary(run)
    assert summary["resumed_from"]["step"] == stopped_at and summary["steps"] == STEPS
    assert not (run / LOCK).exists()
    assert_same_run(run, reference)
    assert [r["step"] for r in rundir.read_metrics(run) if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert summary["trackers"]["tensorboard"]["failed"] == "RuntimeError: injected in tracker log"
    for backend in ("mlflow", "wandb"):
        assert summary["trackers"][backend]["failed"], summary["trackers"]
        assert resumed.stderr.count(f"tracker {backend} ") == 1


def _fsdp_recipe(cache_dir: Path, out: Path, path: Path) -> Path:
    """_recipe's run on FSDP2 (the tiny Llama: FSDP2 shards decoder layers), dropout on."""
    raw = yaml.safe_load(_recipe(cache_dir, out, path).read_text())
    raw["model"]["name_or_path"] = "tiny:llama"
    raw["data"].update({"format": "instruction", "max_length": "auto"})
    raw["train"]["max_steps"] = FSDP_STEPS
    raw["distributed"]["strategy"] = "fsdp"
    path.write_text(yaml.safe_dump(raw))
    return path


FSDP_STEPS = 6


@pytest.mark.slow
def test_fsdp2_preempted_with_dropout_on_resumes_in_a_fresh_process_like_uninterrupted(cache_dir, tmp_path):
    """FSDP2 (docs/backends.md) preempted: SIGTERM to the launcher after step 2 stops the ranks at a step
    boundary with a preempted checkpoint (exit 75); a relaunch, a fresh process that restores the sharded
    state, the optimizer and each rank's RNG from the checkpoint (dropout on: the masks after the resume
    must be those of the uninterrupted run), ends as the uninterrupted run: every step's loss, the adapter."""
    reference = tmp_path / "reference"
    proc = launch(_fsdp_recipe(cache_dir, reference, tmp_path / "reference.yaml"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    run = tmp_path / "run"
    recipe = _fsdp_recipe(cache_dir, run, tmp_path / "recipe.yaml")
    stopped = launch(recipe, fault="term:2")
    assert stopped.returncode == 75, stopped.stderr[-5000:]
    ckpts = complete_checkpoints(run)
    stopped_at = ckpts[-1].step
    assert 2 <= stopped_at < FSDP_STEPS and ckpts[-1].state["reason"] == "preempted"
    resumed = launch(recipe)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert _resumed_from(resumed, run, stopped_at)
    assert rundir.read_summary(run)["strategy"] == "fsdp"
    assert_same_run(run, reference, FSDP_STEPS)
