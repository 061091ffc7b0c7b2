"""Generate builtin:mnli_sample, a small MNLI-shaped dataset: (premise, hypothesis) -> entailment, neutral or
contradiction, in parquet files with the columns and split names of GLUE MNLI on the hub.

    python -m lorakit.data.samples.make_mnli_sample      # rewrite the shipped files

Why synthetic: no dataset can be downloaded here, and the MNLI recipe's whole path (several columns in one
prompt, integer labels with ClassLabel names, validation_matched / validation_mismatched, accuracy and a
confusion matrix) must run on a CPU in a minute. The relation is made of simple, learnable cues a tiny
random model picks up: an entailed hypothesis restates part of the premise, a contradiction negates it, a
neutral one adds a detail the premise does not give. validation_mismatched draws its sentences from another
"genre" (other subjects and actions), as MNLI's mismatched split does.
"""

from __future__ import annotations

import random
from pathlib import Path

import datasets

SEED = 7
LABELS = ["entailment", "neutral", "contradiction"]
SIZES = {"train": 2000, "validation_matched": 200, "validation_mismatched": 200}

GENRES = {
    "everyday": {
        "subjects": [
            "a man",
            "a woman",
            "the boy",
            "the girl",
            "an old man",
            "two children",
            "a teacher",
            "the players",
            "a doctor",
            "the farmer",
            "a young woman",
            "the family",
        ],
        "actions": [
            ("playing", "a guitar"),
            ("reading", "a book"),
            ("riding", "a bike"),
            ("cooking", "dinner"),
            ("painting", "a wall"),
            ("washing", "a car"),
            ("carrying", "a bag"),
            ("watching", "a game"),
            ("eating", "an apple"),
            ("building", "a fence"),
        ],
        "places": [
            "in the park",
            "at home",
            "near the river",
            "on the street",
            "in the kitchen",
            "at the beach",
            "in the garden",
            "at school",
        ],
    },
    "government": {
        "subjects": [
            "the senator",
            "a committee",
            "the company",
            "the manager",
            "the mayor",
            "an agency",
            "the council",
            "a lawyer",
        ],
        "actions": [
            ("approving", "a budget"),
            ("reviewing", "the report"),
            ("signing", "a contract"),
            ("planning", "a meeting"),
            ("discussing", "the law"),
            ("funding", "a project"),
        ],
        "places": ["in the city", "at the office", "in the capital", "at the hearing", "in the region"],
    },
}
DETAILS = [
    "because it is sunny",
    "for the first time",
    "with a friend",
    "to earn money",
    "every morning",
    "after a long day",
    "for an hour",
    "with great care",
]
NEGATIONS = [
    "{s} is not {v} {o}",
    "nobody is {v} {o} {p}",
    "{s} is never {v} anything",
    "{s} is sleeping and not {v} {o}",
]
ENTAILED = ["{s} is {v} {o}", "someone is {v} {o} {p}", "{s} is {v} something", "{s} is {p}"]


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def make_example(rng: random.Random, genre: dict, label: int) -> dict:
    """One (premise, hypothesis, label) row of `genre` with the relation `label`."""
    s, (v, o), p = rng.choice(genre["subjects"]), rng.choice(genre["actions"]), rng.choice(genre["places"])
    premise = _sentence(f"{s} is {v} {o} {p}")
    if LABELS[label] == "entailment":
        hypothesis = rng.choice(ENTAILED).format(s=s, v=v, o=o, p=p)
    elif LABELS[label] == "neutral":
        hypothesis = f"{s} is {v} {o} {rng.choice(DETAILS)}"
    else:
        hypothesis = rng.choice(NEGATIONS).format(s=s, v=v, o=o, p=p)
    return {"premise": premise, "hypothesis": _sentence(hypothesis), "label": label}


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every split as a list of rows; a pure function of `seed`."""
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for split, size in SIZES.items():
        genre = GENRES["government" if split == "validation_mismatched" else "everyday"]
        rows = [make_example(rng, genre, rng.randrange(len(LABELS))) for _ in range(size)]
        out[split] = [{**row, "idx": i} for i, row in enumerate(rows)]
    return out


FEATURES = datasets.Features(
    {
        "premise": datasets.Value("string"),
        "hypothesis": datasets.Value("string"),
        "label": datasets.ClassLabel(names=LABELS),
        "idx": datasets.Value("int32"),
    }
)


def write(out_dir: Path, seed: int = SEED) -> dict[str, Path]:
    """Write {split}.parquet into `out_dir` (features, ClassLabel names included, in the file's metadata)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in generate(seed).items():
        ds = datasets.Dataset.from_list(rows, features=FEATURES)
        paths[split] = out_dir / f"{split}.parquet"
        ds.to_parquet(str(paths[split]))
    return paths


def main() -> None:
    """Regenerate the shipped files next to this module."""
    for split, path in write(Path(__file__).resolve().parent / "mnli_sample").items():
        print(f"{split}: {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
