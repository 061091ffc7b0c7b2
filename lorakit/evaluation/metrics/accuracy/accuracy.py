"""Accuracy over label strings (MNLI style), loadable offline by `evaluate.load(path)`.

evaluate copies this one file into its modules cache and imports it from there: the normalisation it
shares with exact_match comes from lorakit.evaluation.metric_base by absolute import, one import per line
(evaluate's import scanner reads them line by line).
"""

import evaluate

from lorakit.evaluation.metric_base import match_rate, normalize, string_pair_info

_DESCRIPTION = """\
Accuracy for generated class labels: the predicted label text is compared with the reference label
text (e.g. "entailment", "neutral", "contradiction"). Both are normalised as in exact_match: stripped,
whitespace runs collapsed to one space, case-insensitive unless ignore_case is false.

With first_token_only, only the first whitespace-separated word of the prediction is kept, with
punctuation and quotes trimmed from its ends, so a generation like "Entailment. The premise says..."
counts as "entailment". References are never truncated, so multi-word reference labels can only match
with first_token_only off.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted label strings (model generations).
    references: list of reference label strings, one per prediction.
    ignore_case: compare case-insensitively (default True).
    first_token_only: compare only the first word of each prediction (default False).
Returns:
    dict with key accuracy: fraction of correct labels in [0, 1].
Examples:
    >>> from lorakit.evaluation import load_metric
    >>> acc = load_metric("accuracy")
    >>> acc.compute(predictions=["Neutral."], references=["neutral"], first_token_only=True)["accuracy"]
    1.0
"""

# Trimmed from the ends of the first word only; "_" and "-" stay because labels use them (not_entailment).
_EDGE_PUNCTUATION = ".,;:!?\"'`()[]{}<>\u201c\u201d\u2018\u2019"


def normalize_label(text: str, ignore_case: bool = True, first_token_only: bool = False) -> str:
    """Normalise a label string the way accuracy compares it."""
    text = normalize(text, ignore_case=False)
    if first_token_only:
        text = text.split(" ", 1)[0].strip(_EDGE_PUNCTUATION)
    return text.casefold() if ignore_case else text


class Accuracy(evaluate.Metric):
    """Fraction of predicted label strings equal to the reference label."""

    def _info(self):
        return string_pair_info(_DESCRIPTION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, ignore_case=True, first_token_only=False):
        rate = match_rate(
            "accuracy",
            predictions,
            references,
            lambda prediction: normalize_label(prediction, ignore_case, first_token_only),
            lambda reference: normalize_label(reference, ignore_case),
        )
        return {"accuracy": rate}
