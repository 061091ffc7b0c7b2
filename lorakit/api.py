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

from lorakit import dist, preflight, rundir, runlock
from lorakit.backends import backend_for
from lorakit.engine.launch import (
    launch_env,
    launched_distributed,
    process_group,
    root_cause_line,
    torchrun_command,
)
from lorakit.engine.result import EXIT, TrainResult
from lorakit.engine.signals import STOP_SIGNALS
from lorakit.errors import (
    CollectiveTimeoutError,
    DiskFullError,
    ExtensionLockError,
    LorakitError,
    PublishError,
    RankFailedError,
    RunDirError,
    RunLockedError,
    WorkerFailedError,
)
from lorakit.export import publish
from lorakit.model.cpu_products import forced_setting
from lorakit.observe import trackers
from lorakit.preflight import prepare
from lorakit.recipe import Recipe, dump_recipe
from lorakit.recipe.read_back import module_of


def doctor(recipe=None, **options):
    """Check this machine for `recipe` (environment, contracts, speed, memory plan); returns a
    DoctorReport. Options: quick, output, devices. See lorakit.doctor and docs/doctor.md."""
    from lorakit.doctor.core import run_doctor

    return run_doctor(recipe, **options)


def merge_after_training(recipe: Recipe, result: TrainResult) -> TrainResult:
    """output.merge: merge the saved adapter (or re-export the full model) into run_dir/merged and record
    merged_dir in summary.json. Rank 0, after run_job has returned, so the training model, engine and
    process group are gone and only the merge's one copy of the model is in memory."""
    import gc

    from lorakit.export import merge

    gc.collect()
    # The training job holds the run lock already.
    # Trust as the person's own recipe grants it (never the run directory's copy of it).
    trust = {"trust_remote_code": recipe.model.trust_remote_code, "allow_pickle": recipe.model.allow_pickle}
    trust["allow_code"] = [
        module_of(spec) for spec in (recipe.train.objective_module, recipe.data.transform) if spec
    ]
    merged = merge(
        result.run_dir, result.run_dir / rundir.MERGED, dtype=recipe.model.dtype, lock=False, **trust
    )
    summary = {**result.summary, "merged_dir": str(merged.output_dir)}
    rundir.write_json(result.run_dir / rundir.SUMMARY, summary)
    return TrainResult(result.run_dir, summary)


def train(recipe: Recipe, train_dataset=None, eval_dataset=None) -> TrainResult:
    """Train `recipe` and return its run directory and summary. `train_dataset` / `eval_dataset`
    (datasets.Dataset) replace data.source's rows (lorakit.data.source_files.with_datasets).

    Inside a launched group (torchrun, deepspeed) or for a 1-process recipe this trains in-process.
    A recipe asking for more processes than this one is validated here (its data included, so bad input
    fails before any run directory exists) and then run under torchrun.

    First, before any tokenizing or model loading: output.dir and data.cache_dir are checked (RunDirError)
    and the run lock is taken (RunLockedError when another run holds it), by this process, or by rank 0
    under a launcher that is not lorakit's; it is held until the job, merge included, is over. See
    docs/resume.md#one-run-directory-one-writer.
    """
    if train_dataset is not None:
        from lorakit.data.source_files import with_datasets

        recipe = with_datasets(recipe, train_dataset, eval_dataset)
    if recipe.method.quantization():
        from lorakit.model.quantize import require_bitsandbytes

        require_bitsandbytes()  # before any tokenizing, worker or run directory
    # Likewise the libraries of output.report_to (wandb, mlflow, tensorboard): a missing one is exit 2 now,
    # not a crash of rank 0 after the model has loaded.
    trackers.require(recipe.output.report_to)
    publish.check_before_training(recipe.output.push_to_hub)
    check_extension_locks()
    forced_setting()  # LORAKIT_CPU_BF16_MATMUL: a bad value is exit 2 now, not a crash of every rank

    if launched_distributed():
        # Workers of `python -m lorakit.run` find their launcher's lock token in their environment; a job
        # that torchrun or the deepspeed launcher started directly takes the lock on rank 0.
        return _train_in_group(recipe, lock_on_rank0=not runlock.held_by_launcher(run_dir=recipe.output.dir))
    # Bad input (model directory, tokenizer, data files, columns, rows) is exit 2 here: before the lock
    # makes output.dir and before any worker starts; a directory another run holds, before any of that work.
    runlock.refuse_if_held_here(recipe.output.dir)
    _check_run_dir(recipe)
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    # The same command again on a finished run: its summary is the answer (train.resume: never trains anew).
    if recipe.train.resume == "auto" and rundir.completed_with(run_dir, dump_recipe(recipe)):
        return TrainResult(run_dir, rundir.read_summary(run_dir), already_complete=True)
    prepared = prepare(recipe)
    if recipe.distributed.num_processes == 1 and not prepared.cache_hit:
        print(prepared.describe(), flush=True)  # the job says it reused this cache
    with runlock.RunLock(recipe.output.dir, claim=True) as lock:
        if recipe.preflight.doctor:
            from lorakit.doctor.preflight import run_preflight

            run_preflight(recipe)  # docs/doctor.md: a failed check stops here, before the model loads
        if recipe.distributed.num_processes == 1:
            return _train_in_group(recipe, lock_on_rank0=False)
        return _launch_workers(recipe, lock, prepared)


def check_extension_locks() -> None:
    """A stale lock in the torch extensions cache is an error now, naming the file to remove: left alone,
    the run would wait on it forever while DeepSpeed builds its ops."""
    from lorakit.engine.extension_locks import describe_stale_locks, stale_locks

    stale = stale_locks()
    if stale:
        raise ExtensionLockError(describe_stale_locks(stale))


def _check_run_dir(recipe: Recipe) -> None:
    """Refuse an output.dir no run may write into, then one that is not writable or lacks space (and a bad
    data.cache_dir)."""
    # Before the writability probe: a directory lorakit did not make gets no file, not even for a moment.
    rundir.check_trusted(Path(recipe.output.dir).expanduser().resolve())
    preflight.check_run_paths(recipe)


def _guard_run_dir(recipe: Recipe) -> runlock.RunLock:
    """Check output.dir and data.cache_dir, then take the run lock (a context manager that releases it)."""
    _check_run_dir(recipe)
    return runlock.RunLock(recipe.output.dir, claim=True)


def _train_in_group(recipe: Recipe, *, lock_on_rank0: bool) -> TrainResult:
    from lorakit.engine.job import run_job
    from lorakit.planner.run_plan import plan_of_run

    run_dir = Path(recipe.output.dir).expanduser().resolve()
    lock = None
    try:
        with (
            process_group(recipe.distributed.backend, recipe.distributed.timeout_minutes),
            warnings.catch_warnings(),
        ):
            # DeepSpeed calls torch.distributed APIs that torch deprecated, and warns on every step.
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
            if lock_on_rank0:
                lock = _lock_on_rank0(recipe)
            result = _recording_exit(run_dir, run_job, recipe, plan_of_run)
            main = dist.is_main()
        if recipe.output.merge and main:
            result = _recording_exit(run_dir, merge_after_training, recipe, result)
        if recipe.output.push_to_hub is not None and main:
            result = _recording_exit(run_dir, publish.push_after_training, recipe, result)
        return result
    finally:
        if lock is not None:
            lock.release()


def _lock_on_rank0(recipe: Recipe) -> runlock.RunLock | None:
    """Under a launcher that is not lorakit's: rank 0 checks the paths and takes the lock (every rank raises
    when it could not, so none waits for the others forever)."""
    lock, error, failure = None, None, None
    if dist.is_main():
        try:
            lock = _guard_run_dir(recipe).acquire()
        except (RunDirError, RunLockedError) as e:
            error = (type(e).__name__, str(e))
        except Exception as e:  # not bad input, but the other ranks must still learn that rank 0 stopped
            failure, error = e, ("RuntimeError", f"rank 0 could not check or lock output.dir: {e!r}")
    error = dist.broadcast_object(error)
    if failure is not None:
        raise failure
    if error is not None:
        kinds = {"RunDirError": RunDirError, "RunLockedError": RunLockedError}
        raise kinds.get(error[0], RuntimeError)(error[1])
    return lock


def _recording_exit(run_dir: Path, fn, *args):
    """Run `fn(*args)`; its failure is recorded in run_dir/exit.json for the launcher to exit with its code
    and one line (record_failure). Failures inside the job's agreements (dist.py) are recorded the
    moment they happen, before the agreement's collective, which may never complete."""
    try:
        with dist.recording_failures(lambda e: record_failure(run_dir, e)):
            return fn(*args)
    except Exception as e:
        record_failure(run_dir, e)
        raise


def record_failure(run_dir: Path, error: BaseException) -> None:
    """Write `error` as run_dir/exit.json for the launcher: a full disk (any rank may hit it: each writes its
    own shards), a failed push (rank 0), a preemption or divergence (every rank) with its code and message; a crash, or a collective a vanished
    peer left unfinished, as one line naming the rank, phase and step, unless a rank recorded its failure first. Another rank's failure
    (RankFailedError) is that rank's to record."""
    from lorakit.engine.loop import Preempted, TrainingDiverged

    if isinstance(error, RankFailedError):
        return
    # A preemption or divergence stops every rank together with the same message: recorded as itself by
    # whichever rank gets here first (rank 0's Job.train writes it too), never as that rank's own failure.
    if isinstance(error, (DiskFullError, PublishError, Preempted, TrainingDiverged)):
        info = {"code": error.exit_code, "error": type(error).__name__, "message": str(error)}
    elif (run_dir / EXIT).exists():
        return
    else:
        code = error.exit_code if isinstance(error, LorakitError) else 1
        info = {"code": code, "error": "WorkerFailedError", "message": dist.describe_failure(error)}
        # A collective a vanished peer left unfinished is no root cause: the launcher names the peer if it
        # died without a record of its own (launch.root_cause_line), saying where this rank was stuck.
        if isinstance(error, CollectiveTimeoutError):
            info |= {"peer_lost": True, "rank": dist.rank(), "where": getattr(error, "lorakit_where", None)}
    with contextlib.suppress(OSError, DiskFullError):
        rundir.write_json(run_dir / EXIT, info)


def _launch_workers(recipe: Recipe, lock: runlock.RunLock, prepared) -> TrainResult:
    # What the workers' backend would refuse of this group (ZeRO++'s qwZ / qgZ on CPU) is refused here,
    # before data and torchrun.
    n = recipe.distributed.num_processes
    backend_for(recipe).check_before_launch(n, n)
    print(prepared.describe(), flush=True)
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    from lorakit.engine.checkpoint import find_resume

    # A checkpoint the workers would refuse (another recipe, another world size) is refused here, with
    # exit code 2 and before torchrun starts.
    find_resume(recipe, run_dir, world=recipe.distributed.num_processes)
    # A stale exit.json from an earlier launch must not be mistaken for this one's.
    (run_dir / EXIT).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="lorakit-") as tmp:
        resolved = Path(tmp) / "recipe.yaml"
        resolved.write_text(dump_recipe(recipe))
        # torchrun through lorakit.engine.agent, which says how each failed rank ended (failures.json).
        failures = Path(tmp) / "failures.json"
        cmd = torchrun_command(n, "lorakit.run", [str(resolved), "--worker"], failures)
        # Child processes pick the work up from the cache this process just wrote; the lock token tells them
        # this process holds the run lock for them.
        returncode = _run_forwarding_signals(cmd, {**launch_env(), **lock.environment()}, lock.add_child)
        _after_workers(run_dir, returncode, json.loads(failures.read_text()) if failures.is_file() else {})
    return TrainResult(run_dir, rundir.read_summary(run_dir))


def _after_workers(run_dir: Path, returncode: int, failures: dict | None = None) -> None:
    """Once torchrun has returned: re-raise a worker's failure in this process with its exit code, or name
    the rank that died without an error of its own (`failures`, lorakit.engine.agent's report). A rank
    that failed a checkpoint save removes its partial directory, but another rank may still have been writing
    into it; with every worker gone (and the lock still held) this process removes what is left."""
    if returncode == 0:
        return
    from lorakit.engine.checkpoint import remove_partial_saves

    remove_partial_saves(run_dir)
    _raise_worker_exit(run_dir, failures or {})
    raise RuntimeError(f"training failed in a worker process (exit code {returncode}); see the log above")


def _run_forwarding_signals(cmd: list[str], env: dict[str, str], started=None) -> int:
    """Run torchrun, passing SIGTERM/SIGUSR1 sent to this process on to it (torchrun hands SIGTERM to the
    workers, which then save a checkpoint and stop), so stopping the launcher stops the run cleanly.
    `started(pid)` is called once torchrun runs. If this process is interrupted (Ctrl-C), torchrun is
    stopped and waited for, so the run lock is not released while workers still write."""
    proc = subprocess.Popen(cmd, env=env)
    if started is not None:
        started(proc.pid)
    previous = {}

    def forward(signum, frame):
        # torchrun handles SIGTERM (not SIGUSR1, which would kill it outright): always send SIGTERM.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        return proc.wait()
    except BaseException:
        forward(signal.SIGTERM, None)
        proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_worker_exit(run_dir: Path, failures: dict) -> None:
    """Re-raise, in the launching process, a worker's preemption, divergence, full disk or failure with its
    exit code (a failure as the one line its rank recorded), or name a rank that died without an error of
    its own (killed by a signal: exit code 1 for the run)."""
    from lorakit.engine.loop import Preempted, TrainingDiverged

    path = run_dir / EXIT
    info = json.loads(path.read_text()) if path.is_file() else None
    died = root_cause_line(info, failures)
    if died is not None:
        raise WorkerFailedError(died, doc="docs/faults.md#a-rank-that-dies")
    if info is None:
        return
    kinds = {"Preempted": Preempted, "TrainingDiverged": TrainingDiverged, "DiskFullError": DiskFullError}
    kinds["PublishError"] = PublishError
    if info.get("error") in kinds:
        raise kinds[info["error"]](info["message"])
    if info.get("error") == WorkerFailedError.__name__:
        raise WorkerFailedError(info["message"], exit_code=int(info.get("code", 1)))
