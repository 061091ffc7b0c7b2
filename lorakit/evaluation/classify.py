"""Classification runs (label words as targets, e.g. MNLI): per-class counts, a confusion matrix, and its plot.

A generated prediction is compared with the label words after the normalisation the accuracy and
exact_match metrics use (whitespace collapsed, case ignored); one that is no label word is counted in an
`invalid` column, so a model that answers off-label is visible, not silently wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INVALID = "(invalid)"
_WHITESPACE = re.compile(r"\s+")


def normalize_label(text: str) -> str:
    """A label word as the accuracy metric compares it: stripped, whitespace collapsed, case folded."""
    return _WHITESPACE.sub(" ", text).strip().casefold()


def match_label(text: str, labels: Sequence[str]) -> str | None:
    """The label word `text` is (compared as normalize_label does), or None when it is no label word."""
    wanted = normalize_label(text)
    return next((label for label in labels if normalize_label(label) == wanted), None)


def classification_report(
    predictions: Sequence[str], references: Sequence[str], labels: Sequence[str]
) -> dict[str, Any]:
    """Per-class support, predictions, hits, precision and recall, the confusion matrix (rows: reference
    label, columns: predicted label then INVALID) and the count of predictions that are no label word."""
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions but {len(references)} references")
    index = {normalize_label(label): i for i, label in enumerate(labels)}
    invalid = len(labels)
    matrix = [[0] * (len(labels) + 1) for _ in labels]
    for prediction, reference in zip(predictions, references, strict=True):
        row = index.get(normalize_label(reference))
        if row is None:
            raise ValueError(f"reference {reference!r} is not one of the labels {list(labels)}")
        matrix[row][index.get(normalize_label(prediction), invalid)] += 1
    per_class = {}
    for i, label in enumerate(labels):
        support, predicted, hits = sum(matrix[i]), sum(r[i] for r in matrix), matrix[i][i]
        per_class[label] = {
            "support": support,
            "predicted": predicted,
            "correct": hits,
            "precision": hits / predicted if predicted else None,
            "recall": hits / support if support else None,
        }
    total = len(predictions)
    return {
        "labels": list(labels),
        "columns": [*labels, INVALID],
        "confusion_matrix": matrix,
        "per_class": per_class,
        "invalid": sum(r[invalid] for r in matrix),
        "accuracy": sum(matrix[i][i] for i in range(len(labels))) / total if total else None,
        "examples": total,
    }


def plot_confusion_matrix(report: dict[str, Any], path: Path, title: str = "confusion matrix") -> None:
    """Draw the report's confusion matrix (counts, rows normalised for the colour) as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lorakit.observe.plot import save_figure

    matrix, rows, columns = report["confusion_matrix"], report["labels"], report["columns"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(columns), 1.2 + 0.9 * len(rows)))
    shares = [[v / max(sum(r), 1) for v in r] for r in matrix]
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    for i, r in enumerate(matrix):
        for j, v in enumerate(r):
            ax.text(j, i, str(v), ha="center", va="center", color="white" if shares[i][j] > 0.6 else "black")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("predicted")
    ax.set_ylabel("reference")
    accuracy = report["accuracy"]
    ax.set_title(
        f"{title} (accuracy {accuracy:.1%}, {report['invalid']} invalid)" if accuracy is not None else title
    )
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)


def save_classification(report: dict[str, Any], path: Path, plot: Path) -> None:
    """Write a classification report as JSON at `path` and its confusion matrix as a PNG at `plot`."""
    from lorakit import rundir

    rundir.write_json(path, report)
    plot_confusion_matrix(report, plot)
