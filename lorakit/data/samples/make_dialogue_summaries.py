"""Generate the builtin `dialogue_summaries` dataset: synthetic messenger chats with SAMSum-style summaries.

Run `python -m lorakit.data.samples.make_dialogue_summaries` to (re)write
dialogue_summaries/{train,validation}.jsonl next to this file. The output is a pure function of SEED: only
`random.Random` is used, so the files are byte-identical on every machine and Python version that keeps
`random`'s documented seeding guarantees.

Shape of the data, and why:
- Columns `dialogue` and `summary`, like SAMSum, so one recipe maps both datasets the same way.
- A dialogue is a chat of 2-4 people, one turn per line ("Name: utterance"). It settles one to four facts
  (who will do what, when, where, how many), each in a short exchange, amid small talk that mentions other
  names, days and numbers as distractors. The summary states the facts in the third person, one sentence
  each, in the order the chat settles them; each fact kind has one summary template whatever the wording
  of its exchange, so the summary is a function of the dialogue and a tiny model learns it (falling loss)
  in minutes on a CPU.
- Both sides are long-tailed, as in SAMSum: the number of turns is lognormal (median 7, half of the chats
  5-11 turns, the longest ~30), and longer chats settle more facts, so summaries run from one short
  sentence to four long ones. Random micro-batches padded to their longest member are about half padding
  on the source side, which is what length grouping and packing are for. docs/data.md has the measured
  token lengths.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lorakit.data.samples import SampleGenerator

SEED = 20240923
NUM_TRAIN = 1000
NUM_VALIDATION = 100
# Lognormal number of turns before the caps: median ~6 plus the fact exchanges' own turns. The character
# cap stops the small talk of the longest chats: at most ~415 tokens of the tiny tokenizer (~440 with a
# prompt template), safely within the tiny models' 512.
_TURNS_MU = 1.8
_TURNS_SIGMA = 0.66
_MAX_TURNS = 60
_MAX_CHARS = 800
# Four long facts would pass 100 summary tokens: a fact that would take the summary past this many
# characters is left out (neither said nor summarised), which keeps the longest summaries under ~90 tokens.
_MAX_SUMMARY_CHARS = 195
# Participants per chat: mostly two, as in SAMSum.
_PARTICIPANTS = ((2, 0.6), (3, 0.25), (4, 0.15))

FIRST_NAMES = (
    "Anna Tom Kate Jake Mia Liam Emma Olivia Noah Sophie Ben Chloe Ryan Zoe Max Lily Sam Ella Josh Grace "
    "Leo Hannah Adam Ruby Dan Megan Luke Amy Harry Jess Nina Marco Lena Pedro Sara Julia Rosa Ethan Paolo "
    "Hugo Clara Felix Nadia Omar Priya Kenji Elena Ivy"
).split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
VENUES = [
    "the Blue Door cafe", "Mario's pizzeria", "the park entrance", "the Red Lion", "the cinema",
    "the library", "Green Street market", "the climbing gym", "the old bakery", "the bus stop on Hill Road",
]  # fmt: skip
RESTAURANTS = ["Luigi's", "the Golden Dragon", "Casa Verde", "the Olive Tree", "Sakura", "Bombay Palace"]
PLACES = ["the station", "the airport", "the bus station", "school", "work", "the gym", "the dentist"]
EVENTS = [
    "the party", "the barbecue", "game night", "the picnic", "the housewarming", "the office party",
    "the birthday dinner", "the match on Saturday",
]  # fmt: skip
SUPPLIES = [
    "bottles of wine", "packs of beer", "bags of ice", "pizzas", "bags of crisps", "cakes",
    "packs of paper plates", "bottles of juice",
]  # fmt: skip
THINGS_PAID = ["the concert tickets", "the taxi", "the groceries", "the hotel room", "the pizza", "the gift"]
OBJECTS = ["the drill", "the car", "the camera", "the tent", "the ladder", "the projector", "the bike"]
DOCUMENTS = [
    "the photos from the wedding", "the notes from class", "the report", "the link to the flat",
    "the new address", "the slides", "the recipe",
]  # fmt: skip
WHEN = ["tonight", "tomorrow morning", "after lunch", "this evening", "in an hour", "tomorrow"]
SHOWS = ["the jazz concert", "the football match", "the comedy show", "the new Bond film", "the ballet"]
PETS = ["cat", "dog", "fish", "rabbit", "parrot", "hamster"]
REASONS = ["the traffic", "the train", "a meeting", "the rain", "a flat tyre"]
TESTS = ["the driving test", "the exam", "the interview", "the audition", "the test"]
CITIES = ["Lisbon", "Prague", "Dublin", "Krakow", "Porto", "Vienna", "Oslo", "Seville", "Bristol", "Lyon"]


def _time(rng: random.Random, evening: bool = False) -> str:
    """A clock time as chats and summaries write it: "6 pm", "9:30 am"."""
    if evening:
        return f"{rng.randint(6, 10)}{rng.choice(['', '', ':30'])} pm"
    if rng.random() < 0.3:
        return f"{rng.randint(8, 11)}{rng.choice(['', ':30'])} am"
    return f"{rng.randint(1, 9)}{rng.choice(['', '', ':15', ':30', ':45'])} pm"


# Fact kinds (data: dialogue_facts.json beside this file): a summary template and several exchanges that
# settle the same fact in different words. An exchange is a list of [speaker, utterance]: "A" does the
# thing, "B" is the other person in it. Every slot of the summary is in each exchange, so the summary is
# determined by the chat.
FACTS: dict[str, dict] = json.loads((Path(__file__).parent / "dialogue_facts.json").read_text())
_FACT_KINDS = sorted(FACTS)

# Small talk: exchanges between two random participants ("X" opens, "Y" answers), with other people's
# names, days and numbers that the summary must not pick up.
SMALL_TALK = [
    [("X", "how was your weekend?"), ("Y", "good, we went hiking with {other}")],
    [("X", "did you see the match last night?"), ("Y", "yes, {n} goals, crazy")],
    [("X", "it's so cold today"), ("Y", "I know, I'm wearing {n} layers")],
    [("X", "{other} says hi btw"), ("Y", "say hi back!")],
    [("X", "have you heard from {other}?"), ("Y", "not since {weekday}")],
    [("X", "lol")],
    [("X", "haha")],
    [("X", "ok")],
    [("X", ":)")],
    [("X", "<file_photo>"), ("Y", "so cute!!")],
    [("X", "<file_gif>")],
    [("X", "how was {city}?"), ("Y", "amazing, it rained only {n} days"), ("X", "lucky you")],
    [("X", "I watched {n} episodes yesterday"), ("Y", "of what?"), ("X", "the one {other} recommended")],
    [("X", "my sister is visiting on {weekday}"), ("Y", "nice, for how long?"), ("X", "{n} days I think")],
    [("X", "I'm so tired today"), ("Y", "same")],
    [("X", "did {other} get the job?"), ("Y", "yes! starting on {weekday}")],
    [("X", "the traffic this morning was insane"), ("Y", "tell me about it, it took me {n} minutes")],
    [("X", "what are you doing?"), ("Y", "cooking, and you?"), ("X", "nothing much")],
    [("X", "omg {other} just texted me"), ("Y", "and?"), ("X", "tell you later")],
    [("X", "anyone seen my keys? :D"), ("Y", "no lol")],
    [("X", "I ran {n} km this morning"), ("Y", "wow, respect")],
    [("X", "is it true that {other} moved to {city}?"), ("Y", "yes, in {month}")],
    [("X", "the new phone is great, the battery lasts {n} hours")],
    [("X", "remember when we got lost in {city}?"), ("Y", "haha yes, with {other}"), ("Y", "good times")],
]  # fmt: skip
MONTHS = "January February March April May June July August September October November December".split()
GREETINGS = [
    [("X", "hey"), ("Y", "hi! what's up?")],
    [("X", "hi :)")],
    [("X", "hello hello"), ("Y", "hey you")],
]
CLOSINGS = [[("X", "ok, see you!"), ("Y", "bye!")], [("X", "great, thanks")], [("X", "cool")]]
GROUP_CLOSINGS = [[("X", "great, thanks everyone")], [("X", "see you all!")]]


def _slots(rng: random.Random, kind: str) -> dict[str, str]:
    """Slot values for one fact; every exchange and summary template draws from this one dict."""
    if rng.random() < 0.25:
        day = day_phrase = rng.choice(["tomorrow", "tonight"])
    else:
        day = rng.choice(DAYS)
        day_phrase = f"on {day}"  # "Friday" in the chat, "on Friday" in the summary
    if kind in ("buy", "book", "tickets"):
        n = rng.randint(2, 12)
    elif kind == "owe":
        n = rng.randint(8, 160)
    else:
        n = rng.randint(5, 45)
    return {
        "place": rng.choice(PLACES),
        # Dinners and shows are in the evening, as is anything "tonight".
        "time": _time(rng, evening=day == "tonight" or kind in ("book", "tickets")),
        "day": day,
        "day_phrase": day_phrase,
        "weekday": rng.choice(DAYS),
        "venue": rng.choice(VENUES),
        "restaurant": rng.choice(RESTAURANTS),
        "event": rng.choice(EVENTS),
        "supplies": rng.choice(SUPPLIES),
        "paid": rng.choice(THINGS_PAID),
        "object": rng.choice(OBJECTS),
        "document": rng.choice(DOCUMENTS),
        "when": rng.choice(WHEN),
        "show": rng.choice(SHOWS),
        "pet": rng.choice(PETS),
        "reason": rng.choice(REASONS),
        "test": rng.choice(TESTS),
        "n": str(n),
    }


def _cast(
    exchange: list[tuple[str, str]], roles: dict[str, str], slots: dict[str, str]
) -> list[tuple[str, str]]:
    """The exchange's turns as (name, utterance), its roles played by `roles` and its slots filled."""
    return [(roles[role], text.format(**slots)) for role, text in exchange]


def _pair(rng: random.Random, people: list[str]) -> dict[str, str]:
    """Two different participants for a small-talk exchange's roles X (opens) and Y (answers)."""
    x, y = rng.sample(people, 2)
    return {"X": x, "Y": y}


def _num_facts(rng: random.Random, turns: int) -> int:
    """More turns settle more facts (SAMSum's longer chats have longer summaries), with some spread."""
    expected = 0.55 + turns / 9
    return min(4, max(1, round(expected + rng.gauss(0, 0.6))))


def _chars(turns: list[tuple[str, str]]) -> int:
    return sum(len(f"{who}: {text}\n") for who, text in turns)


def make_example(rng: random.Random) -> dict[str, str]:
    """One synthetic chat and its summary."""
    count = rng.choices([c for c, _ in _PARTICIPANTS], weights=[w for _, w in _PARTICIPANTS])[0]
    people = rng.sample(FIRST_NAMES, count)
    others = [n for n in FIRST_NAMES if n not in people]
    turns = min(_MAX_TURNS, max(2, round(rng.lognormvariate(_TURNS_MU, _TURNS_SIGMA))))

    blocks, summary = [], []
    for kind in rng.sample(_FACT_KINDS, _num_facts(rng, turns)):
        fact = FACTS[kind]
        a, b = rng.sample(people, 2)
        slots = {**_slots(rng, kind), "A": a, "B": b}
        sentence = fact["summary"].format(**slots)
        if summary and len(" ".join(summary)) + 1 + len(sentence) > _MAX_SUMMARY_CHARS:
            break  # neither said nor summarised: keeps the longest summaries near 90 tokens
        blocks.append(_cast(rng.choice(fact["chats"]), {"A": a, "B": b}, slots))
        summary.append(sentence)

    # Small talk fills the turns the facts leave, in random gaps between and around the fact exchanges. Its
    # exchanges come in a shuffled cycle, so a long chat repeats one only after using them all.
    gaps: list[list[tuple[str, str]]] = [[] for _ in range(len(blocks) + 1)]
    if turns >= 6 and rng.random() < 0.4:
        gaps[0] += _cast(rng.choice(GREETINGS), _pair(rng, people), {})
    budget = turns - sum(map(len, blocks)) - len(gaps[0])
    chars = _chars(gaps[0]) + sum(map(_chars, blocks))
    order = rng.sample(SMALL_TALK, len(SMALL_TALK))
    for exchange in order * (1 + _MAX_TURNS // len(order)):
        if budget <= 0:
            break
        slots = {
            "other": rng.choice(others),
            "n": str(rng.randint(2, 40)),
            "weekday": rng.choice(DAYS),
            "city": rng.choice(CITIES),
            "month": rng.choice(MONTHS),
        }
        talk = _cast(exchange, _pair(rng, people), slots)
        if chars + _chars(talk) > _MAX_CHARS:
            break
        gaps[rng.randrange(len(gaps))] += talk
        budget -= len(talk)
        chars += _chars(talk)
    if turns >= 8 and rng.random() < 0.5:
        closings = CLOSINGS + (GROUP_CLOSINGS if len(people) > 2 else [])
        gaps[-1] += _cast(rng.choice(closings), _pair(rng, people), {})

    lines = list(gaps[0])
    for block, gap in zip(blocks, gaps[1:], strict=True):
        lines += block + gap
    return {"dialogue": "\n".join(f"{who}: {text}" for who, text in lines), "summary": " ".join(summary)}


SAMPLES = SampleGenerator("dialogue_summaries", make_example, SEED, NUM_TRAIN, NUM_VALIDATION)
# generate(seed=SEED): all splits as lists of rows; write(out_dir, seed=SEED): their {split}.jsonl files.
generate, write = SAMPLES.generate, SAMPLES.write

if __name__ == "__main__":
    SAMPLES.main()
