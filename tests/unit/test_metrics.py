"""lorakit.evaluation: the ROUGE / exact_match / accuracy modules and compute_metrics."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from rouge_score import rouge_scorer

from lorakit.evaluation import METRICS, compute_metrics, load_metric, metric_path

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _script(name):
    """Import a metric script directly, to unit-test its helpers."""
    path = metric_path(name) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_lorakit_test_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_registry_points_at_scripts():
    assert set(METRICS) == {"rouge", "exact_match", "accuracy"}
    for name in METRICS:
        assert (metric_path(name) / f"{name}.py").is_file()


def test_identical_texts_score_100():
    texts = ["The cat sat on the mat. It purred.", "entailment holds", "Résumé: two lines\nof text!"]
    result = compute_metrics(["rouge", "exact_match", "accuracy"], texts, list(texts))
    assert result == {key: 100.0 for key in (*ROUGE_KEYS, "exact_match", "accuracy")}


def test_rouge_partial_overlap_by_hand():
    # pred tokens: the cat sat on the mat | ref tokens: the cat lay on the rug
    # unigrams: the x2, cat, on -> 4/6; bigrams: "the cat", "on the" -> 2/5; LCS "the cat on the" -> 4/6.
    result = compute_metrics(["rouge"], ["the cat sat on the mat"], ["the cat lay on the rug"])
    assert result == {"rouge1": 66.6667, "rouge2": 40.0, "rougeL": 66.6667, "rougeLsum": 66.6667}


def test_rouge_matches_rouge_score_mean_over_examples():
    predictions = ["a quick brown fox jumps", "summaries are hard to score", "nothing in common"]
    references = [
        "the quick brown fox jumped over",
        "scoring summaries is hard",
        "completely different words",
    ]
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    expected = {key: 0.0 for key in ROUGE_KEYS}
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score(reference, prediction)
        for key in ROUGE_KEYS:
            expected[key] += scores[key].fmeasure / len(predictions)
    result = compute_metrics(["rouge"], predictions, references)
    for key in ROUGE_KEYS:
        assert result[key] == pytest.approx(100 * expected[key], abs=1e-4)
    assert 0 < result["rouge1"] < 100


def test_rouge_stemming_option():
    rouge = load_metric("rouge")
    stemmed = rouge.compute(predictions=["running dogs"], references=["run dog"])
    plain = rouge.compute(predictions=["running dogs"], references=["run dog"], use_stemmer=False)
    assert stemmed["rouge1"] == 1.0
    assert plain["rouge1"] == 0.0
    per_example = rouge.compute(predictions=["a b", "c"], references=["a b", "d"], use_aggregator=False)
    assert per_example["rouge1"] == [1.0, 0.0]


def test_rougelsum_rewards_reordered_sentences_more_than_rougel():
    # Same two sentences in swapped order: the whole-text LCS covers only one of them (6 of 12 tokens),
    # the summary-level LCS matches each sentence with its counterpart.
    prediction = "The dog ran in the park. The cat sat on the mat."
    reference = "The cat sat on the mat. The dog ran in the park."
    result = compute_metrics(["rouge"], [prediction], [reference])
    assert result["rougeL"] == 50.0
    assert result["rougeLsum"] == 100.0
    assert result["rouge1"] == 100.0


def test_metric_scripts_share_code_only_by_absolute_one_line_imports():
    # evaluate copies each script alone into its modules cache: a relative import would not resolve there,
    # and its import scanner reads imports line by line.
    import ast

    for name in METRICS:
        source = (metric_path(name) / f"{name}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}.py: relative import of {node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert node.lineno == node.end_lineno, f"{name}.py:{node.lineno}: import over several lines"
    assert _script("accuracy").normalize is _script("exact_match").normalize


def test_sentence_splitter():
    split = _script("rouge").split_sentences
    assert split('He paid 3.5 dollars. "Really?!" she asked.  Yes\nNo') == (
        'He paid 3.5 dollars.\n"Really?!"\nshe asked.\nYes\nNo'
    )
    assert split("  one sentence without a stop ") == "one sentence without a stop"


@pytest.mark.parametrize(
    ("prediction", "reference", "options", "match"),
    [
        ("  The   Cat\n", "the cat", {}, True),
        ("STRASSE", "straße", {}, True),  # casefold, not lower
        ("The cat", "the cat", {"ignore_case": False}, False),
        (" the cat ", "the cat", {"strip": False}, False),
        ("the  cat", "the cat", {"collapse_whitespace": False}, False),
        ("the\tcat", "the cat", {"strip": False}, True),
        ("Paris.", "Paris", {}, False),  # no punctuation stripping
    ],
)
def test_exact_match_normalisation(prediction, reference, options, match):
    result = load_metric("exact_match").compute(predictions=[prediction], references=[reference], **options)
    assert result == {"exact_match": 1.0 if match else 0.0}


def test_exact_match_fraction_in_percent():
    result = compute_metrics(["exact_match"], ["a", "B", "c", "d"], ["a", "b", "x", "y"])
    assert result == {"exact_match": 50.0}


def test_accuracy_on_label_strings():
    predictions = ["entailment", "Neutral", " contradiction ", "neutral"]
    references = ["entailment", "neutral", "contradiction", "entailment"]
    assert compute_metrics(["accuracy"], predictions, references) == {"accuracy": 75.0}

    accuracy = load_metric("accuracy")
    generations = ["Entailment. The premise says so.", "neutral,", '"contradiction"', "not_entailment"]
    labels = ["entailment", "neutral", "contradiction", "not_entailment"]
    assert accuracy.compute(predictions=generations, references=labels, first_token_only=True) == {
        "accuracy": 1.0
    }
    assert accuracy.compute(predictions=generations, references=labels) == {"accuracy": 0.25}
    assert accuracy.compute(predictions=["Neutral"], references=["neutral"], ignore_case=False) == {
        "accuracy": 0.0
    }


def test_accuracy_normalises_like_exact_match():
    em, acc = _script("exact_match"), _script("accuracy")
    for text in ["  A\t b \n", "STRASSE", "x"]:
        assert acc.normalize_label(text) == em.normalize(text)


def test_unknown_metric_name():
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'.*accuracy, exact_match, rouge"):
        load_metric("bleu")
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        compute_metrics(["rouge", "bleu"], ["a"], ["a"])


def test_bad_inputs():
    with pytest.raises(TypeError, match="list of metric names"):
        compute_metrics("rouge", ["a"], ["a"])
    with pytest.raises(ValueError, match="at least one"):
        compute_metrics(["rouge"], [], [])
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        compute_metrics(["exact_match"], ["a", "b"], ["a"])


_WORKER = textwrap.dedent(
    """
    import json, os, socket, sys, time

    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(repr(address))
        raise OSError("network is off in this test")

    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse

    from lorakit.evaluation import compute_metrics
    import evaluate

    # Both workers pay for the slow imports first, then race on the empty modules cache together.
    open(sys.argv[2], "w").close()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.005)
    result = compute_metrics(["rouge", "exact_match", "accuracy"], ["the cat sat", "yes"], ["the cat sat", "no"])
    print(json.dumps({"result": result, "network": attempts}))
    """
)


@pytest.mark.slow
def test_fresh_cache_offline_and_concurrent(tmp_path):
    """Two processes load all metrics at once into one empty HF cache, with and without HF_HUB_OFFLINE."""
    cache = tmp_path / "hf"
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_HOME=str(cache),
        HF_MODULES_CACHE=str(cache / "modules"),
        HF_EVALUATE_CACHE=str(cache / "evaluate"),
        HF_METRICS_CACHE=str(cache / "metrics"),
    )
    workers, ready = [], []
    for offline in (True, False):
        ready.append(tmp_path / f"ready-{offline}")
        worker_env = dict(env, HF_HUB_OFFLINE="1") if offline else env
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(go), str(ready[-1])],
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 300
    while not all(path.exists() for path in ready) and time.monotonic() < deadline:
        if any(worker.poll() is not None for worker in workers):
            break  # a worker died during its imports; communicate() below shows why
        time.sleep(0.01)
    go.touch()
    expected = {"rouge1": 50.0, "rouge2": 50.0, "rougeL": 50.0, "rougeLsum": 50.0}
    expected.update(exact_match=50.0, accuracy=50.0)
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report == {"result": expected, "network": []}
        # No Hub warnings or progress bars: loading by path is silent.
        assert stderr.strip() == ""
    assert sorted(
        p.name for p in (cache / "modules" / "evaluate_modules" / "metrics").iterdir() if p.is_dir()
    ) == [
        "accuracy",
        "exact_match",
        "rouge",
    ]
