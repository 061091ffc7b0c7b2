"""ROUGE-1/2/L/Lsum F-measure, computed with `rouge_score`, loadable offline by `evaluate.load(path)`.

This file is copied by `evaluate` into its modules cache and imported from there, so it must not use
relative imports (what it shares comes from lorakit.evaluation.metric_base by absolute import) and keeps
one `import` per line: evaluate's import scanner reads the source line by line to check that every
imported library is installed.
"""

import re

import evaluate
from rouge_score import rouge_scorer

from lorakit.evaluation.metric_base import string_pair_info

_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
    address = "Barcelona, Spain",
    publisher = "Association for Computational Linguistics",
    url = "https://aclanthology.org/W04-1013",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-1, ROUGE-2 (unigram/bigram overlap), ROUGE-L (longest common subsequence over the whole text)
and ROUGE-Lsum (summary-level LCS: union of LCS matches computed sentence by sentence), scored with
Google's `rouge_score` package. Tokenisation is rouge_score's: lowercase, every run of characters
outside [a-z0-9] is a separator (so non-Latin text scores 0), Porter stemming of words longer than
3 characters when `use_stemmer` is true. A text of one token has no bigrams, so its ROUGE-2 is 0 even
against itself (rouge_score's convention).

The F-measure of each example is averaged over examples (plain arithmetic mean, values in [0, 1]).
This is deterministic; it is not the bootstrap median that HF's `rouge` reports, which can differ in
the last digits.

Sentences for ROUGE-Lsum are found with a small regex splitter (a break after `.`, `!` or `?`,
optionally followed by closing quotes or brackets, then whitespace; existing newlines are kept), not
nltk's punkt, so results never depend on downloadable nltk data. It splits after abbreviations such
as "Dr." where punkt would not. ROUGE-1/2/L ignore the sentence breaks.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of generated texts, one per example.
    references: list of reference texts, one per example.
    use_stemmer: Porter-stem words before matching (default True, as in FLAN-T5 fine-tuning guides).
    use_aggregator: return the mean over examples (default True) or one score per example (False).
Returns:
    dict with keys rouge1, rouge2, rougeL, rougeLsum: F-measure in [0, 1] (float, or list of floats
    when use_aggregator is False).
Examples:
    >>> from lorakit.evaluation import load_metric
    >>> rouge = load_metric("rouge")
    >>> rouge.compute(predictions=["the cat sat"], references=["the cat sat"])["rouge1"]
    1.0
"""

# A sentence ends at . ! ? (possibly repeated, e.g. "?!"), then optional closing quotes/brackets,
# then whitespace. Requiring whitespace keeps decimals ("3.5") and URLs ("a.b") in one piece.
_SENTENCE_END = re.compile(r"([.!?]+[\"'\u201d\u2019)\]]*)\s+")


def split_sentences(text: str) -> str:
    """Put each sentence of `text` on its own line (the input format rouge_score wants for ROUGE-Lsum)."""
    marked = _SENTENCE_END.sub("\\1\n", text.strip())
    return "\n".join(line.strip() for line in marked.splitlines() if line.strip())


class Rouge(evaluate.Metric):
    """ROUGE-1/2/L/Lsum F-measure averaged over examples."""

    def _info(self):
        return string_pair_info(
            _DESCRIPTION,
            _KWARGS_DESCRIPTION,
            _CITATION,
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
            reference_urls=["https://aclanthology.org/W04-1013"],
        )

    def _compute(self, predictions, references, use_stemmer=True, use_aggregator=True):
        if not predictions:
            raise ValueError("rouge needs at least one prediction/reference pair")
        scorer = rouge_scorer.RougeScorer(list(_ROUGE_TYPES), use_stemmer=use_stemmer)
        per_type = {rouge_type: [] for rouge_type in _ROUGE_TYPES}
        for prediction, reference in zip(predictions, references, strict=True):
            # Newlines only matter to rougeLsum: rouge_score's tokenizer treats them as separators.
            scores = scorer.score(split_sentences(reference), split_sentences(prediction))
            for rouge_type in _ROUGE_TYPES:
                per_type[rouge_type].append(scores[rouge_type].fmeasure)
        if not use_aggregator:
            return per_type
        return {rouge_type: sum(values) / len(values) for rouge_type, values in per_type.items()}
