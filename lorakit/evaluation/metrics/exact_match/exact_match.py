"""Exact match after light normalisation, loadable offline by `evaluate.load(path)`.

evaluate copies this one file into its modules cache and imports it from there: what it shares with the
other metrics comes from lorakit.evaluation.metric_base by absolute import, one import per line (evaluate's
import scanner reads them line by line).
"""

import evaluate

from lorakit.evaluation.metric_base import match_rate, normalize, string_pair_info

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


class ExactMatch(evaluate.Metric):
    """Exact string match after strip / whitespace collapse / case folding."""

    def _info(self):
        return string_pair_info(_DESCRIPTION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, strip=True, collapse_whitespace=True, ignore_case=True):
        options = {"strip": strip, "collapse_whitespace": collapse_whitespace, "ignore_case": ignore_case}
        rate = match_rate("exact_match", predictions, references, lambda text: normalize(text, **options))
        return {"exact_match": rate}
