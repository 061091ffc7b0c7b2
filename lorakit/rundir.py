"""The run directory: what a run leaves behind, and how it describes itself."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from lorakit import disclosure, storage
from lorakit.lock_holder import LOCK

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
EXIT = "exit.json"
# lorakit's mark on a directory it made (or adopted) as a run directory: only such a directory, an empty
# one or a new one is written into (check_trusted).
MARKER = ".lorakit-run"
# The directories a run replaces whole (storage.replace_directory), whose leftovers recover() cleans.
REPLACED = (ADAPTER, MODEL, MERGED, BEST)
# Every name a run writes, replaces, moves aside or deletes in its directory: none may be a link.
WRITTEN = (
    *REPLACED,
    CHECKPOINTS,
    TENSORBOARD,
    WANDB,
    RECIPE,
    DS_CONFIG,
    "fsdp_config.json",
    METRICS,
    SUMMARY,
    EXIT,
    TRACKERS,
    LOSS_PLOT,
    CLASSIFICATION,
    CONFUSION_MATRIX,
    PREDICTIONS,
    MARKER,
)
TRUST_DOC = "docs/faults.md#run-directory-durability-and-trust"

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
    """Write JSON atomically and durably, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json_if_exists(path: Path) -> Any:
    """The JSON document at `path`, or None when there is no such file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_text(path: Path, text: str) -> None:
    """Write text atomically and durably (storage.write_file); on a full disk, a DiskFullError naming the
    file and no temp file left."""
    text = disclosure.redact(text)  # no credential lands in a run directory (lorakit/disclosure.py)
    with storage.writing(path.name, path):
        storage.write_file(path, text)


def check_trusted(run_dir: Path) -> str:
    """Whether a run may write into `run_dir`: "new" (missing), "empty", "marked" (lorakit's marker) or
    "older" (a run directory of a lorakit from before the marker, known by content only lorakit writes:
    recipe.yaml and a summary.json recording lorakit's version, or a checkpoint's state.json holding its
    recipe). Anything else is a RunDirError (exit 2) naming the directory: a run replaces adapter/,
    model/, merged/ and best/ and starts its trackers there, which must never touch what lorakit did not
    write (`output.dir: .` in a project with a model/ package). A link where a run writes (WRITTEN, and in
    checkpoints/) is a RunDirError naming it: a run never follows one to replace or delete its target."""
    from lorakit.errors import RunDirError

    run_dir = Path(run_dir)
    if not run_dir.exists():
        return "new"
    if not run_dir.is_dir():
        return "new"  # preflight.check_directory names a file in the way
    if _is_marker(run_dir / MARKER):
        check_links(run_dir)
        return "marked"
    # The run lock (and its temporary files) is lorakit's too: a directory holding only a lock is empty.
    names = sorted(p.name for p in run_dir.iterdir() if not p.name.lstrip(".").startswith(LOCK))
    if not names:
        return "empty"
    if _older_run(run_dir):
        check_links(run_dir)
        return "older"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise RunDirError(
        f"output.dir {run_dir} is not empty and is not a lorakit run directory (it holds {shown}); a run "
        "writes only into a new or empty directory or one a lorakit run made. Point output.dir at a new "
        "directory (e.g. runs/NAME)",
        doc=TRUST_DOC,
    )


def _read_json(path: Path) -> Any:
    """The JSON of a regular file (not a link) of at most 1 MiB, or None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_run_directory(path: str | Path) -> bool:
    """Whether `path` is a directory a lorakit run wrote (its marker, or an older run's content)."""
    path = Path(path)
    return path.is_dir() and (_is_marker(path / MARKER) or _older_run(path))


def _is_marker(path: Path) -> bool:
    data = _read_json(path)
    return isinstance(data, dict) and "lorakit_run_directory" in data


def _older_run(run_dir: Path) -> bool:
    """Proof that a lorakit from before the marker wrote `run_dir`: its recipe.yaml, and a summary.json
    whose `versions` names lorakit or a checkpoint whose state.json holds the run's recipe and loop."""
    recipe = run_dir / RECIPE
    if recipe.is_symlink() or not recipe.is_file():
        return False
    summary = _read_json(run_dir / SUMMARY)
    if isinstance(summary, dict) and isinstance(summary.get("versions"), dict):
        if "lorakit" in summary["versions"]:
            return True
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for state in sorted(checkpoints.glob("step-*/state.json"))[:8]:
            data = _read_json(state)
            if isinstance(data, dict) and isinstance(data.get("recipe"), dict) and "loop" in data:
                return True
    return False


def check_links(run_dir: Path) -> None:
    """RunDirError (exit 2) naming the first link where a run writes, replaces, moves aside or deletes:
    the names of WRITTEN and what is in checkpoints/."""
    from lorakit.errors import RunDirError

    places = [run_dir / name for name in WRITTEN]
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        places += sorted(checkpoints.iterdir())
    for path in places:
        if path.is_symlink():
            raise RunDirError(
                f"output.dir: {path} is a symbolic link; a run replaces, moves aside or deletes what is "
                "there and never follows a link to do it. Remove the link (its target stays as it is) or "
                "point output.dir at a new directory",
                doc=TRUST_DOC,
            )


def check_recipe_file(recipe_file: str | Path, output_dir: str | Path, resolved: str) -> None:
    """RunDirError (exit 2) when the recipe file given on the command line is output.dir's recipe.yaml and
    the run's resolved recipe differs from it: the run would write over the file it was given. An equal
    one is left as it is (write_recipe)."""
    from lorakit.errors import RunDirError

    given, dump = Path(recipe_file), Path(output_dir).expanduser() / RECIPE
    try:
        same = given.is_file() and dump.is_file() and given.samefile(dump)
    except OSError:
        return
    if same and given.read_text() != disclosure.redact(resolved):  # as write_text writes it
        raise RunDirError(
            f"{recipe_file} is the run's recipe.yaml in output.dir, where the run writes its resolved recipe; "
            "lorakit never writes over the recipe file it was given: copy it out of the run directory and "
            "run the copy",
            doc=TRUST_DOC,
        )


def write_recipe(run_dir: Path, resolved: str) -> None:
    """Write the resolved recipe to run_dir/recipe.yaml, unless it holds that text already (a relaunch of
    `python -m lorakit.run RUN/recipe.yaml` leaves the file it was given untouched)."""
    path = run_dir / RECIPE
    if not path.is_symlink() and path.is_file() and path.read_text() == disclosure.redact(resolved):
        return
    write_text(path, resolved)


def mark(run_dir: Path) -> None:
    """Write lorakit's marker into `run_dir` (a directory check_trusted accepted), durably."""
    if not (run_dir / MARKER).is_file():
        write_json(run_dir / MARKER, {"lorakit_run_directory": 1})


def recover(run_dir: Path) -> list[str]:
    """Clean what a crash left in `run_dir` while replacing adapter/, model/, merged/ or best/ (the old one
    put back if the new one is missing); returns what was done. Only under the run lock."""
    done = []
    for name in REPLACED:
        done += storage.recover_directory(run_dir / name)
    return done


def write_predictions(run_dir: Path, predictions: list[str], references: list[str]) -> None:
    """eval_predictions.jsonl: each generation next to its reference, in eval row order."""
    lines = (
        json.dumps({"prediction": p, "reference": r}) for p, r in zip(predictions, references, strict=True)
    )
    write_text(run_dir / PREDICTIONS, "\n".join(lines) + "\n")


def completed_with(run_dir: str | Path, resolved_recipe: str) -> bool:
    """Whether `run_dir` holds a run that finished with this very recipe (`resolved_recipe`, as the run
    wrote it to recipe.yaml): its summary.json written after its recipe.yaml (a later launch that stopped
    early rewrote the recipe and left no newer summary), no exit.json (a failure, a preemption), and, when it
    saved checkpoints, its last one still there (removed since: the relaunch resumes from the rest)."""
    run_dir = Path(run_dir)
    summary, recipe = run_dir / SUMMARY, run_dir / RECIPE
    try:
        if (run_dir / EXIT).exists() or summary.stat().st_mtime_ns < recipe.stat().st_mtime_ns:
            return False
        finished = read_summary(run_dir)
        if recipe.read_text() != resolved_recipe or not finished.get("stop_reason"):
            return False
        # The run's last checkpoint (summary.json's last_checkpoint, by name: the folder may have moved).
        last = finished.get("last_checkpoint")
        return last is None or (run_dir / CHECKPOINTS / Path(last).name / "state.json").is_file()
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary.json of a finished run."""
    return json.loads((Path(run_dir) / SUMMARY).read_text())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl."""
    lines = (Path(run_dir) / METRICS).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
