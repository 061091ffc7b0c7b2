"""The Python API: load a recipe, prepare its data, train it."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from lorakit import rundir
from lorakit.data import PreparedData, prepare_data
from lorakit.engine import dist
from lorakit.engine.job import TrainResult
from lorakit.engine.launch import launch_env, launched_distributed, process_group, torchrun_command
from lorakit.engine.signals import STOP_SIGNALS
from lorakit.model import load_config, load_tokenizer
from lorakit.recipe import Recipe, dump_recipe


def prepare(recipe: Recipe) -> PreparedData:
    """Tokenize and cache the recipe's data (or find it cached); needs no GPU."""
    source, config = load_config(recipe)
    return prepare_data(recipe, load_tokenizer(recipe, source), config)


def merge_after_training(recipe: Recipe, result: TrainResult) -> TrainResult:
    """output.merge: merge the saved adapter (or re-export the full model) into run_dir/merged and record
    merged_dir in summary.json. Rank 0, after run_job has returned, so the training model, engine and
    process group are gone and only the merge's one copy of the model is in memory."""
    import gc

    from lorakit.export import merge

    gc.collect()
    merged = merge(result.run_dir, result.run_dir / rundir.MERGED, dtype=recipe.model.dtype)
    summary = {**result.summary, "merged_dir": str(merged.output_dir)}
    rundir.write_json(result.run_dir / rundir.SUMMARY, summary)
    return TrainResult(result.run_dir, summary)


def train(recipe: Recipe) -> TrainResult:
    """Train `recipe` and return its run directory and summary.

    Inside a launched group (torchrun, deepspeed) or for a 1-process recipe this trains in-process.
    A recipe asking for more processes than this one is validated here (its data included, so bad input
    fails before any run directory exists) and then run under torchrun.
    """
    from lorakit.engine.job import run_job

    if recipe.method.quantization():
        from lorakit.model.quantize import require_bitsandbytes

        require_bitsandbytes()  # before any tokenizing, worker or run directory

    if launched_distributed() or recipe.distributed.num_processes == 1:
        with process_group(recipe.distributed.backend), warnings.catch_warnings():
            # DeepSpeed calls torch.distributed APIs that torch deprecated, and warns on every step.
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
            result = run_job(recipe)
            main = dist.is_main()
        return merge_after_training(recipe, result) if recipe.output.merge and main else result
    print(prepare(recipe).describe(), flush=True)
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    from lorakit.engine.checkpoint import find_resume

    # A checkpoint the workers would refuse (another recipe, another world size) is refused here, with
    # exit code 2 and before torchrun starts.
    find_resume(recipe, run_dir, world=recipe.distributed.num_processes)
    from lorakit.engine.job import EXIT

    # A stale exit.json from an earlier launch must not be mistaken for this one's.
    (run_dir / EXIT).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="lorakit-") as tmp:
        resolved = Path(tmp) / "recipe.yaml"
        resolved.write_text(dump_recipe(recipe))
        cmd = torchrun_command(recipe.distributed.num_processes, "lorakit.run", [str(resolved), "--worker"])
        # Child processes pick the work up from the cache this process just wrote.
        returncode = _run_forwarding_signals(cmd)
    if returncode != 0:
        _raise_worker_exit(run_dir)
        raise RuntimeError(f"training failed in a worker process (exit code {returncode}); see the log above")
    return TrainResult(run_dir, rundir.read_summary(run_dir))


def _run_forwarding_signals(cmd: list[str]) -> int:
    """Run torchrun, passing SIGTERM/SIGUSR1 sent to this process on to it (torchrun hands SIGTERM to the
    workers, which then save a checkpoint and stop), so stopping the launcher stops the run cleanly."""
    proc = subprocess.Popen(cmd, env=launch_env())
    previous = {}

    def forward(signum, frame):
        # torchrun handles SIGTERM (not SIGUSR1, which would kill it outright): always send SIGTERM.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_worker_exit(run_dir: Path) -> None:
    """Re-raise, in the launching process, a worker's preemption or divergence with its exit code."""
    from lorakit.engine.job import EXIT
    from lorakit.engine.loop import Preempted, TrainingDiverged

    path = run_dir / EXIT
    if not path.is_file():
        return
    info = json.loads(path.read_text())
    kinds = {"Preempted": Preempted, "TrainingDiverged": TrainingDiverged}
    if info.get("error") in kinds:
        raise kinds[info["error"]](info["message"])
