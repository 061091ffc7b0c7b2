"""Generate the builtin `preference_pairs` dataset: (question, chosen, rejected) rows for DPO smoke runs.

Run `python -m lorakit.data.samples.make_preference_pairs` to (re)write preference_pairs/{train,
validation}.jsonl next to this file; the files are a pure function of SEED.

Why synthetic, and this shape: no dataset can be downloaded here, and a DPO run must show preference
accuracy rising from 50% to above 90% on held-out pairs with a tiny random model in a few dozen CPU steps.
The question (the prompt) asks to describe a scene (who does what, where). The chosen answer describes it with the
prompt's own words; the rejected one is unhelpful: a refusal, a change of subject or a vague reply, some
of them naming the prompt's subject, so the preference is not a single token. A tiny model learns to
prefer the helpful answer; held-out pairs use the same scene parts in new combinations.
"""

from __future__ import annotations

import random

from lorakit.data.samples import SampleGenerator

SEED = 20261125
NUM_TRAIN = 600
NUM_VALIDATION = 100

SUBJECTS = (
    "a man|a woman|the boy|the girl|an old man|two children|a teacher|the players|a doctor|the farmer|"
    "a young woman|the family|a nurse|the driver|a student|the cook"
).split("|")
ACTIONS = (
    "playing a guitar|reading a book|riding a bike|cooking dinner|painting a wall|washing a car|"
    "carrying a bag|watching a game|eating an apple|building a fence|writing a letter|feeding a dog"
).split("|")
PLACES = (
    "in the park|at home|near the river|on the street|in the kitchen|at the beach|in the garden|at school|"
    "in the city|at the market"
).split("|")
ASKS = (
    "Describe the scene: {scene}.",
    "What is happening here? {scene}.",
    "Tell me what you see: {scene}.",
)
UNHELPFUL = (
    "I do not want to answer that.",
    "No. Ask someone else about {subject}.",
    "That is not interesting. Let us talk about the weather.",
    "I cannot say anything about {subject}.",
    "Something happens somewhere, I suppose.",
    "Why would I tell you?",
)


def make_example(rng: random.Random) -> dict[str, str]:
    """One pair: a scene prompt, its faithful description (chosen) and an unhelpful reply (rejected)."""
    subject, action, place = rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(PLACES)
    scene = f"{subject} {action} {place}"
    verb = "are" if subject.startswith("two") or subject == "the players" else "is"
    return {
        "question": rng.choice(ASKS).format(scene=scene),
        "chosen": f"{subject[0].upper()}{subject[1:]} {verb} {action} {place}.",
        "rejected": rng.choice(UNHELPFUL).format(subject=subject),
    }


SAMPLES = SampleGenerator("preference_pairs", make_example, SEED, NUM_TRAIN, NUM_VALIDATION)


if __name__ == "__main__":
    SAMPLES.main()
