"""Exact match after light normalisation, loadable offline by `evaluate.load(path)`.

Self-contained on purpose: evaluate copies this one file into its modules cache and imports it from
there, so it cannot share helpers with the accuracy metric through a relative import.
"""

import re

import datasets
import evaluate

_DESCRIPTION = """\
Fraction of predictions equal to their reference after normalisation. By default both strings are
stripped, every run of whitespace (spaces, tabs, newlines) becomes one space, and the comparison is
case-insensitive (str.casefold, so "STRASSE" matches "straße"). Each step can be turned off. No
punctuation or article removal: "Paris." does not match "Paris".
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted strings.
    references: list of reference strings, one per prediction.
    strip: remove leading and trailing whitespace (default True).
    collapse_whitespace: replace each run of whitespace with a single space (default True).
    ignore_case: compare case-insensitively (default True).
Returns:
    dict with key exact_match: fraction of exact matches in [0, 1].
Examples:
    >>> from lorakit.evaluation import load_metric
    >>> em = load_metric("exact_match")
    >>> em.compute(predictions=["  The  cat "], references=["the cat"])["exact_match"]
    1.0
"""

_WHITESPACE = re.compile(r"\s+")


def normalize(
    text: str, strip: bool = True, collapse_whitespace: bool = True, ignore_case: bool = True
) -> str:
    """Normalise `text` the way exact_match compares it."""
    if collapse_whitespace:
        text = _WHITESPACE.sub(" ", text)
    if strip:
        text = text.strip()
    if ignore_case:
        text = text.casefold()
    return text


class ExactMatch(evaluate.Metric):
    """Exact string match after strip / whitespace collapse / case folding."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, strip=True, collapse_whitespace=True, ignore_case=True):
        if not predictions:
            raise ValueError("exact_match needs at least one prediction/reference pair")
        options = {"strip": strip, "collapse_whitespace": collapse_whitespace, "ignore_case": ignore_case}
        hits = sum(
            normalize(prediction, **options) == normalize(reference, **options)
            for prediction, reference in zip(predictions, references, strict=True)
        )
        return {"exact_match": hits / len(predictions)}
