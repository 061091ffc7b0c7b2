"""Generate the builtin `kto_rows` dataset: unpaired (prompt, completion, label) rows for KTO smoke runs.

Run `python -m lorakit.data.samples.make_kto_rows` to (re)write kto_rows/{train,validation}.jsonl next to
this file; the files are a pure function of SEED.

The rows are those of `preference_pairs` (make_preference_pairs.py) unpaired, as thumbs-up / thumbs-down
feedback is: each scene prompt comes with ONE completion, its faithful description (label true) or an
unhelpful reply (label false), about half of each, so a KTO run with a tiny random model shows the reward
margin between desirable and undesirable held-out rows turning positive and growing in a few CPU steps.
"""

from __future__ import annotations

import random

from lorakit.data.samples import SampleGenerator
from lorakit.data.samples.make_preference_pairs import make_example as make_pair

SEED = 20261126
NUM_TRAIN = 600
NUM_VALIDATION = 100


def make_example(rng: random.Random) -> dict:
    """One row: a scene prompt and either its description (desirable) or an unhelpful reply."""
    pair = make_pair(rng)
    desirable = rng.random() < 0.5
    return {
        "prompt": pair["question"],
        "completion": pair["chosen" if desirable else "rejected"],
        "label": desirable,
    }


SAMPLES = SampleGenerator("kto_rows", make_example, SEED, NUM_TRAIN, NUM_VALIDATION)


if __name__ == "__main__":
    SAMPLES.main()
