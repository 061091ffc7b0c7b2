"""MLflow: the run's metric records in an MLflow run; by default a file store under output.dir/mlruns.

mlflow is the optional extra `lorakit[mlflow]` (mlflow-skinny: the client; `pip install mlflow` for the
`mlflow ui` server), imported here only, when the sink is made (rank 0).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lorakit.disclosure import redact
from lorakit.observe.records import flat_params, scalars

EXPERIMENT = "lorakit"
# MLflow's limits on one log_batch call, and on a parameter's value.
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_CHARS = 6000


def tracking_uri(run_dir: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else a file store in run_dir/mlruns."""
    from mlflow.environment_variables import MLFLOW_TRACKING_URI

    return MLFLOW_TRACKING_URI.get() if MLFLOW_TRACKING_URI.defined else (run_dir / "mlruns").as_uri()


def allow_file_store(uri: str) -> None:
    """Let MLflow open a file store (a `file:` URI): set MLFLOW_ALLOW_FILE_STORE=true, once, unless the
    user set it.

    MLflow 3.x put its file store in maintenance mode and refuses to open one unless MLFLOW_ALLOW_FILE_STORE
    is true (mlflow/store/tracking/file_store.py), and its client opens the store again on every call. A
    file store is what a recipe gets by default here (no server, no database). Called by rank 0's main
    thread as the trackers are set up, before the sink's threads start: changing the environment (setenv)
    while other threads run can crash a process that reads it at the same time, so the variable stays set
    for the rest of the process rather than being set and unset around each call from the writer thread."""
    if uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"


class MlflowSink:
    """Logs every record's numbers (`kind/name`) at their step to one MLflow run.

    `run_id`: the run to continue (a resumed lorakit run), else a new run named `name` in the experiment
    MLFLOW_EXPERIMENT_NAME (default `lorakit`), with the resolved recipe as parameters.
    """

    def __init__(self, run_dir: Path, name: str, *, run_id: str | None, params: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment = MLFLOW_EXPERIMENT_NAME.get() if MLFLOW_EXPERIMENT_NAME.defined else EXPERIMENT
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            flat = [Param(k, str(v)[:_PARAM_VALUE_CHARS]) for k, v in flat_params(params).items()]
            for i in range(0, len(flat), _PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=flat[i : i + _PARAMS_PER_BATCH])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def describe(self) -> dict[str, Any]:
        """Where the run went, for summary.json (without the URI's credentials)."""
        return {"tracking_uri": redact(self.uri), "run_id": self.run_id}

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's scalars at its step, in one call."""
        from mlflow.entities import Metric

        step, values = scalars(record)
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)
