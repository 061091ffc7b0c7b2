"""The run directory: what a run leaves behind, and how it describes itself."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from lorakit import disclosure, storage

RECIPE = "recipe.yaml"
DS_CONFIG = "ds_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
ADAPTER = "adapter"
MODEL = "model"
MERGED = "merged"
CHECKPOINTS = "checkpoints"
# The adapter (or model) of the best evaluation (checkpoint.best_metric), and what it was.
BEST = "best"
BEST_INFO = "best.json"
# The tracking backends of output.report_to: TensorBoard's event files, W&B's offline runs, and which
# W&B / MLflow run a resumed run continues.
TENSORBOARD = "tensorboard"
WANDB = "wandb"
TRACKERS = "trackers.json"
LOSS_PLOT = "loss.png"
# Classification runs (label targets): the last evaluation's per-class counts and confusion matrix.
CLASSIFICATION = "eval_classification.json"
CONFUSION_MATRIX = "confusion_matrix.png"
PREDICTIONS = "eval_predictions.jsonl"

_PACKAGES = (
    "lorakit",
    "torch",
    "transformers",
    "peft",
    "deepspeed",
    "accelerate",
    "datasets",
    "bitsandbytes",
)


def versions() -> dict[str, str | None]:
    """Versions of python and the packages that shape a run."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(path: str | Path = ".") -> str | None:
    """The git commit of the working directory, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename), so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json_if_exists(path: Path) -> Any:
    """The JSON document at `path`, or None when there is no such file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_text(path: Path, text: str) -> None:
    """Write text atomically; on a full disk, a DiskFullError naming the file and no temp file left."""
    text = disclosure.redact(text)  # no credential lands in a run directory (lorakit/disclosure.py)
    with storage.writing(path.name, path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            # mkstemp makes the file private (0600); give it the mode the user's umask gives any new file.
            os.chmod(tmp, disclosure.file_mode())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_predictions(run_dir: Path, predictions: list[str], references: list[str]) -> None:
    """eval_predictions.jsonl: each generation next to its reference, in eval row order."""
    lines = (
        json.dumps({"prediction": p, "reference": r}) for p, r in zip(predictions, references, strict=True)
    )
    write_text(run_dir / PREDICTIONS, "\n".join(lines) + "\n")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary.json of a finished run."""
    return json.loads((Path(run_dir) / SUMMARY).read_text())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl."""
    lines = (Path(run_dir) / METRICS).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
