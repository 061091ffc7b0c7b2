"""output.report_to: which tracking backends a run writes to, whether their libraries are installed, and
which of their runs a resumed lorakit run continues (run_dir/trackers.json).

The only module that names the backends; each lives in its own module, imported when its sink is made.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

from lorakit import rundir
from lorakit.disclosure import redact, redact_data
from lorakit.errors import MissingExtraError
from lorakit.observe.guard import GuardedSink, start_sinks

# backend -> (module that must import, what to install)
REQUIREMENTS = {
    # A core dependency (the default backend): missing means a broken install.
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", 'pip install "lorakit[wandb]"'),
    "mlflow": ("mlflow", 'pip install "lorakit[mlflow]"'),
}


def require(report_to: list[str] | tuple[str, ...]) -> None:
    """Import the library of every backend in `report_to`, or raise MissingExtraError (exit 2) naming
    what to install, before any training work."""
    for name in report_to:
        module, install = REQUIREMENTS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MissingExtraError(
                f"output.report_to: {name} needs the {module} package, which cannot be imported ({e}); "
                f"install it with {install}, or remove {name} from output.report_to",
                doc="docs/observe.md#install",
            ) from e


def clear(run_dir: Path) -> None:
    """A fresh run (not a resume): remove what an earlier run in this directory left for the trackers,
    saying so (only in a run directory lorakit made: rundir.check_trusted)."""
    for stale in (rundir.TENSORBOARD, rundir.WANDB):
        if (run_dir / stale).is_dir():
            print(
                f"removed {stale}/ of an earlier run in {run_dir}: a fresh run starts new tracker runs",
                flush=True,
            )
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    (run_dir / rundir.TRACKERS).unlink(missing_ok=True)


def open_sinks(
    report_to: list[str] | tuple[str, ...],
    run_dir: Path,
    recipe: dict[str, Any],
    recipe_yaml: str,
    resumed_step: int | None,
    timeout: float = 60.0,
) -> list[Any]:
    """The sinks of `report_to` for rank 0 of a run in `run_dir`; `resumed_step`: the checkpoint's step
    of a resumed run (None: a fresh run, whose trackers start new runs with the recipe as parameters).
    Each starts within `timeout` seconds or is left out with a warning (observe/guard.py); each is guarded
    so that its failures never stop training. Records where each went, or why it failed, in
    run_dir/trackers.json."""
    known = rundir.read_json_if_exists(run_dir / rundir.TRACKERS) or {}
    # The recipe goes to the trackers' servers as parameters: without credentials (a data.source URL's).
    recipe, recipe_yaml = redact_data(recipe), redact(recipe_yaml)
    fresh = resumed_step is None
    name = run_dir.name
    sinks: list[Any] = []
    where: dict[str, Any] = {}
    makers = {
        backend: _maker(backend, run_dir, name, known, fresh, resumed_step, recipe, recipe_yaml, timeout)
        for backend in report_to
    }
    for backend, (sink, why) in start_sinks(makers, timeout).items():
        if sink is None:
            where[backend] = {"failed": why}
            continue
        where[backend] = sink.describe()
        sinks.append(
            GuardedSink(
                backend,
                sink,
                background=backend in REMOTE,
                close_timeout=timeout,
                on_failure=lambda backend, message: record_failure(run_dir, backend, message),
            )
        )
    rundir.write_json(run_dir / rundir.TRACKERS, where)
    return sinks


# Trackers that may talk to a server: they write from a thread of their own (observe/guard.py).
REMOTE = ("wandb", "mlflow")


def _maker(backend, run_dir, name, known, fresh, resumed_step, recipe, recipe_yaml, timeout):
    """A function that builds `backend`'s sink (called in start_sink's thread)."""
    if backend == "tensorboard":

        def make():
            from lorakit.observe.tensorboard_sink import TensorBoardSink

            return TensorBoardSink(
                run_dir / rundir.TENSORBOARD,
                purge_step=None if fresh else resumed_step + 1,
                params=recipe if fresh else None,
                recipe_yaml=recipe_yaml if fresh else None,
            )

    elif backend == "wandb":

        def make():
            from lorakit.observe.wandb_sink import WandbSink

            run_id = None if fresh else known.get("wandb", {}).get("id")
            return WandbSink(run_dir, name, run_id=run_id, config=recipe, init_timeout=timeout)

    else:
        from lorakit.observe.mlflow_sink import allow_file_store, tracking_uri

        allow_file_store(tracking_uri(run_dir))  # here, on the main thread (observe/mlflow_sink.py)

        def make():
            from lorakit.observe.mlflow_sink import MlflowSink

            run_id = None if fresh else known.get("mlflow", {}).get("run_id")
            return MlflowSink(run_dir, name, run_id=run_id, params=recipe)

    return make


def record_failure(run_dir: Path, backend: str, message: str) -> None:
    """Note in trackers.json (and so in summary.json) that `backend` failed during the run."""
    where = rundir.read_json_if_exists(run_dir / rundir.TRACKERS) or {}
    where.setdefault(backend, {})["failed"] = message
    rundir.write_json(run_dir / rundir.TRACKERS, where)


def where(run_dir: Path) -> dict[str, Any]:
    """What run_dir/trackers.json says (backend -> where its records went); {} without trackers."""
    return rundir.read_json_if_exists(run_dir / rundir.TRACKERS) or {}
