"""What lorakit's metric modules (evaluation/metrics/<name>/<name>.py) share.

evaluate copies a metric module alone into its modules cache and imports it from there, so a relative
import would not resolve; the modules import this one by its absolute name, from the installed lorakit
(evaluate's import scanner sees the library `lorakit`, which is installed, and copies nothing).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

_WHITESPACE = re.compile(r"\s+")


def normalize(
    text: str, strip: bool = True, collapse_whitespace: bool = True, ignore_case: bool = True
) -> str:
    """`text` as exact_match compares it: whitespace runs collapsed to one space, stripped, casefolded."""
    if collapse_whitespace:
        text = _WHITESPACE.sub(" ", text)
    if strip:
        text = text.strip()
    if ignore_case:
        text = text.casefold()
    return text


def match_rate(
    metric: str,
    predictions: Sequence[str],
    references: Sequence[str],
    prediction_key: Callable[[str], str],
    reference_key: Callable[[str], str] | None = None,
) -> float:
    """The share of predictions whose key equals their reference's (`reference_key` defaults to
    `prediction_key`); `metric` names the metric in the error for no pairs."""
    if not predictions:
        raise ValueError(f"{metric} needs at least one prediction/reference pair")
    reference_key = reference_key or prediction_key
    hits = sum(
        prediction_key(prediction) == reference_key(reference)
        for prediction, reference in zip(predictions, references, strict=True)
    )
    return hits / len(predictions)


def string_pair_info(description: str, inputs_description: str, citation: str = "", **urls: Any):
    """evaluate.MetricInfo of a metric over (prediction, reference) string pairs."""
    import datasets
    import evaluate

    return evaluate.MetricInfo(
        description=description,
        citation=citation,
        inputs_description=inputs_description,
        features=datasets.Features(
            {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
        ),
        **urls,
    )
