"""Registry of lorakit's metric modules and one call that scores generations with several of them.

The metric modules live in `metrics/<name>/<name>.py` and are loaded by path with `evaluate.load`, so
nothing is fetched from the Hugging Face Hub (a bare name like "rouge" would make evaluate try the Hub
first). evaluate copies each script into its modules cache (HF_MODULES_CACHE/evaluate_modules/metrics/
<name>/<hash of the source>/) under a file lock, so concurrent processes, even on a fresh cache, are safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from lorakit.recipe.eval_section import METRIC_KEYS

if TYPE_CHECKING:
    import evaluate

_METRICS_DIR = Path(__file__).resolve().parent / "metrics"

#: Metric name -> directory holding `<name>.py`, the evaluate module. Read-only.
METRICS: Mapping[str, Path] = MappingProxyType(
    {name: _METRICS_DIR / name for name in ("rouge", "exact_match", "accuracy")}
)


def metric_path(name: str) -> Path:
    """Directory of the evaluate module for metric `name`; ValueError listing known names if unknown."""
    try:
        path = METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(sorted(METRICS))}") from None
    if not (path / f"{name}.py").is_file():
        # Only happens with a broken install: the scripts are package data, not Python packages.
        raise FileNotFoundError(
            f"metric script {path / (name + '.py')} is missing; reinstall lorakit "
            "(package-data 'evaluation/metrics/**/*.py' must be in the wheel)"
        )
    return path


def load_metric(name: str) -> evaluate.EvaluationModule:
    """Load lorakit's metric `name` with `evaluate.load` from its local path (never the Hub)."""
    path = metric_path(name)
    import evaluate  # lazy: `import evaluate` pulls in transformers.pipelines and torch (seconds)

    # keep_in_memory: predictions stay in RAM instead of an arrow file under HF_METRICS_CACHE whose lock
    # ("default_experiment") concurrent processes would otherwise wait on (1 s timeout, then a new name).
    return evaluate.load(str(path), keep_in_memory=True)


def compute_metrics(
    names: Sequence[str], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, float]:
    """Score `predictions` against `references`: flat keys (rouge1, ..., accuracy) in percent, 4 decimals."""
    if isinstance(names, str):
        raise TypeError(f"names must be a list of metric names, got the string {names!r}")
    if not predictions or not references:
        raise ValueError("compute_metrics needs at least one prediction and one reference")
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions but {len(references)} references")
    for name in names:
        metric_path(name)  # fail on an unknown name before loading anything
    results: dict[str, float] = {}
    for name in dict.fromkeys(names):  # drop duplicates, keep order
        scores = load_metric(name).compute(predictions=list(predictions), references=list(references))
        for key in METRIC_KEYS[name]:  # named on the recipe floor, for checkpoint.best_metric
            # Percent, like FLAN-T5 fine-tuning guides report ROUGE.
            results[key] = round(100.0 * float(scores[key]), 4)
    return results
