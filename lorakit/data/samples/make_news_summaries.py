"""Generate the builtin `news_summaries` dataset: synthetic English news with learnable highlights.

Run `python -m lorakit.data.samples.make_news_summaries` to (re)write news_summaries/{train,validation}.jsonl
next to this file. The output is a pure function of SEED: only `random.Random` is used, so the files are
byte-identical on every machine and Python version that keeps `random`'s documented seeding guarantees.

Shape of the data, and why:
- Columns `article` and `highlights`, like cnn_dailymail, so one recipe maps both datasets the same way.
- Each article opens with a lead sentence (who did what, where) and states one key fact (a number) as its
  second or third sentence; the rest is filler with other names and numbers as distractors. The highlights
  restate the lead without its decorations plus the key fact, so a tiny model can learn to summarise
  (falling loss, ROUGE well above zero) in minutes on a CPU.
- Article lengths are lognormal (most 30-80 words, a few up to ~300), so padding every example to the
  longest one wastes about three quarters of the token slots: the case that length grouping and packing fix.
"""

from __future__ import annotations

import random

from lorakit.data.samples import SampleGenerator

SEED = 20240611
NUM_TRAIN = 1000
NUM_VALIDATION = 100
# Lognormal word budget: median ~60 words, a long right tail (a handful above 200); the cap keeps every
# article well under 512 tokens of the tiny tokenizer, so nothing is truncated by default.
_LENGTH_MU = 4.1
_LENGTH_SIGMA = 0.5
_MIN_WORDS = 30
_MAX_WORDS = 340

FIRST_NAMES = (
    "Maria James Aisha Daniel Sofia Kenji Olivia Mateo Priya Lucas Amara Noah Elena Omar Grace Viktor "
    "Hannah Diego Mei Samuel Leila Tomas Chloe Ravi Ingrid Felix Nadia Hugo Zara Arjun Clara Ibrahim "
    "Fatima Oscar Yuki Marco Anna Kwame Lena Pedro Sara Dmitri Julia Ahmed Rosa Ethan Nina Paolo"
).split()
LAST_NAMES = (
    "Garcia Okafor Novak Tanaka Silva Johansson Patel Moreau Kowalski Haddad Reyes Lindqvist Chen Mensah "
    "Fischer Rossi Nakamura Dubois Kumar Petrov Alvarez Brennan Sato Mwangi Larsen Costa Ibrahim Walsh "
    "Yilmaz Herrera Schmidt Osei Bianchi Kim Nilsson Romero Adeyemi Hughes Varga Castillo"
).split()
PLACES = (
    "Lisbon Nairobi Osaka Toronto Krakow Santiago Auckland Marseille Dublin Accra Hamburg Bergen Porto "
    "Valencia Cairo Montreal Glasgow Lagos Turin Seville Utrecht Quito Gdansk Leeds Adelaide Halifax "
    "Bilbao Tallinn Mombasa Cordoba Geneva Bristol Perth Zagreb Lyon Denver Busan Tampere Riga Durban"
).split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = "January February March April May June July August September October November December".split()

# Per topic: organisations, roles, and lead/fact templates with the matching highlight templates.
# A lead template and its highlight share the same slots, so the highlight is a function of the article.
TOPICS = {
    "business": {
        "orgs": (
            "Northwind Foods|Bluepeak Energy|Corvex Motors|Halden Bank|Meridian Textiles|Solano Telecom|"
            "Ardent Pharma|Greyline Shipping|Lumen Robotics|Orchard Retail|Tessera Steel|Vantage Airlines"
        ).split("|"),
        "roles": ["chief executive", "chair", "finance director", "spokesperson", "founder"],
        "verbs": [
            ("open", "opened"),
            ("build", "built"),
            ("close", "closed"),
            ("sell", "sold"),
            ("upgrade", "upgraded"),
            ("buy", "bought"),
        ],
        "things": ["factories", "stores", "warehouses", "offices", "data centres", "plants", "depots"],
        "lead": [
            "{person}, the {role} of {org}, said on {day} that the company will {verb} {n} {things} in {place}.",
            "{org} will {verb} {n} {things} in {place}, its {role} {person} announced on {day}.",
            "In a statement on {day}, {org} {role} {person} confirmed plans to {verb} {n} {things} in {place}.",
        ],
        "fact": [
            "The plan is expected to cost {amount} million dollars over {years} years.",
            "Analysts put the cost of the plan at {amount} million dollars over {years} years.",
        ],
        "hl_lead": "{person} says {org} will {verb} {n} {things} in {place}.",
        "hl_fact": "The plan will cost {amount} million dollars over {years} years.",
    },
    "politics": {
        "orgs": (
            "the city council|the regional assembly|the transport ministry|the health ministry|"
            "the housing agency|the education board|the national parliament|the water authority"
        ).split("|"),
        "roles": ["mayor", "minister", "councillor", "committee chair", "deputy leader"],
        "verbs": [
            ("fund", "funded"),
            ("repair", "repaired"),
            ("replace", "replaced"),
            ("inspect", "inspected"),
            ("expand", "expanded"),
        ],
        "things": ["schools", "bridges", "hospitals", "libraries", "bus routes", "clinics", "parks"],
        "lead": [
            "{person}, a {role}, said on {day} that {org} has voted to {verb} {n} {things} in {place}.",
            "{org_cap} voted on {day} to {verb} {n} {things} in {place}, {role} {person} said.",
            "After a long debate on {day}, {org} agreed to {verb} {n} {things} in {place}, according to {role} {person}.",
        ],
        "fact": [
            "The measure passed by {votes_for} votes to {votes_against}.",
            "Members approved the measure by {votes_for} votes to {votes_against}.",
        ],
        "hl_lead": "{person} says {org} will {verb} {n} {things} in {place}.",
        "hl_fact": "The vote was {votes_for} to {votes_against}.",
    },
    "sports": {
        "orgs": (
            "the Harbour Hawks|the Valley Rovers|the City Comets|the Northern Lions|the River Wolves|"
            "the Coastal Kings|the Mountain Bears|the Union Stars"
        ).split("|"),
        "roles": ["captain", "coach", "striker", "goalkeeper", "team manager"],
        "verbs": [
            ("beat", "beat"),
            ("defeat", "defeated"),
            ("edge past", "edged past"),
            ("overcome", "overcame"),
        ],
        "things": ["points"],
        "lead": [
            "{person}, the {role}, led {org} as they {verb_past} {rival} in {place} on {day}.",
            "{org_cap} {verb_past} {rival} in {place} on {day}, with {role} {person} leading the way.",
            "On {day} in {place}, {org} {verb_past} {rival} thanks to {role} {person}.",
        ],
        "fact": [
            "The final score was {score_a} to {score_b} in front of {crowd} fans.",
            "The match ended {score_a} to {score_b} before a crowd of {crowd} fans.",
        ],
        "hl_lead": "{org_cap} {verb_past} {rival} in {place}, led by {person}.",
        "hl_fact": "The score was {score_a} to {score_b}.",
    },
    "science": {
        "orgs": (
            "the Institute of Marine Studies|the Polar Research Centre|the National Observatory|"
            "the Soil Science Lab|the Genome Project|the Climate Data Unit|the Bee Research Group"
        ).split("|"),
        "roles": ["lead researcher", "professor", "lab director", "senior scientist", "field biologist"],
        "verbs": [
            ("discover", "discovered"),
            ("track", "tracked"),
            ("count", "counted"),
            ("measure", "measured"),
            ("map", "mapped"),
        ],
        "things": [
            "new species",
            "glaciers",
            "coral reefs",
            "bird colonies",
            "meteor showers",
            "rare plants",
        ],
        "lead": [
            "{person}, a {role} at {org}, reported on {day} that the team {verb_past} {n} {things} near {place}.",
            "Scientists at {org} {verb_past} {n} {things} near {place}, {role} {person} said on {day}.",
            "A study published on {day} by {org} shows that researchers {verb_past} {n} {things} near {place}, said {role} {person}.",
        ],
        "fact": [
            "The survey took {months} months and cost {amount} thousand dollars.",
            "The work lasted {months} months and cost {amount} thousand dollars.",
        ],
        "hl_lead": "Researchers at {org} {verb_past} {n} {things} near {place}, says {person}.",
        "hl_fact": "The study took {months} months.",
    },
    "weather": {
        "orgs": (
            "the national weather service|the coastal guard|the emergency agency|the fire service|"
            "the flood control office|the civil defence unit"
        ).split("|"),
        "roles": ["spokesperson", "duty officer", "regional head", "chief forecaster", "station chief"],
        "verbs": [("close", "closed"), ("evacuate", "evacuated"), ("shut", "shut"), ("clear", "cleared")],
        "things": ["roads", "schools", "villages", "ports", "railway lines", "camp sites"],
        "lead": [
            "{person}, the {role} of {org}, said on {day} that a {storm} forced officials to {verb} {n} {things} around {place}.",
            "A {storm} led {org} to {verb} {n} {things} around {place} on {day}, {role} {person} said.",
            "Officials had to {verb} {n} {things} around {place} on {day} after a {storm}, said {person} of {org}.",
        ],
        "fact": [
            "Winds reached {speed} kilometres per hour and {rain} millimetres of rain fell.",
            "Gusts of {speed} kilometres per hour were recorded, with {rain} millimetres of rain.",
        ],
        "hl_lead": "A {storm} forced {org} to {verb} {n} {things} around {place}.",
        "hl_fact": "Winds reached {speed} kilometres per hour.",
    },
}
STORMS = ["heavy storm", "winter storm", "tropical storm", "severe flood", "heat wave", "snow storm"]

# Filler: background, quotes and context with fresh names and numbers, so a model has to find the lead and
# the fact rather than copy any sentence with a number in it.
FILLER = [
    "{person2}, who has followed the issue for {years} years, said the decision was {adj}.",
    "Local residents in {place2} described the news as {adj}.",
    '"We have waited a long time for this," said {person2}, a resident of {place}.',
    "The announcement came {n2} days after a similar move in {place2}.",
    "Critics, including {person2}, argued that the timing was {adj}.",
    "{person2} from {place2} said more details would follow in {month}.",
    "A report released in {month} found that {pct} percent of people in {place} supported the idea.",
    "Officials in {place2} are expected to respond by the end of {month}.",
    "The last comparable project, in {place2}, took {years} years to complete.",
    "Several groups in {place} said they would hold public meetings next week.",
    "{person2} noted that {pct} percent of the budget had already been spent.",
    "Questions remain about how the work will affect traffic in {place}.",
    "Supporters say the change will create about {n2} jobs in the region.",
    "A spokesperson for {place2} declined to comment on the plan.",
    "The story has drawn wide attention on local radio in {place}.",
    "Earlier this year, {person2} called for a review of similar plans in {place2}.",
    "Experts said the figures were {adj} compared with last year.",
    "Some observers in {place2} expect further changes before {month}.",
    "It is the {ordinal} such decision in {place} this decade.",
    "{person2} said the community would watch closely as the work moves ahead.",
]
ADJECTIVES = [
    "welcome", "overdue", "surprising", "bold", "risky", "sensible", "disappointing", "historic",
    "encouraging", "unusual", "modest", "controversial",
]  # fmt: skip
ORDINALS = ["second", "third", "fourth", "fifth"]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _fields(rng: random.Random, topic: dict) -> dict[str, str]:
    """Slot values for one article; every template of every topic draws from this one dict."""
    verb, verb_past = rng.choice(topic["verbs"])
    org = rng.choice(topic["orgs"])
    rivals = [o for o in topic["orgs"] if o != org]
    votes_for = rng.randint(20, 90)
    score_a = rng.randint(1, 6)
    return {
        "person": _person(rng),
        "role": rng.choice(topic["roles"]),
        "org": org,
        "org_cap": org[0].upper() + org[1:],
        "rival": rng.choice(rivals),
        "place": rng.choice(PLACES),
        "day": rng.choice(DAYS),
        "verb": verb,
        "verb_past": verb_past,
        "n": str(rng.randint(2, 60)),
        "things": rng.choice(topic["things"]),
        "amount": str(rng.randint(3, 950)),
        "years": str(rng.randint(2, 12)),
        "months": str(rng.randint(2, 30)),
        "votes_for": str(votes_for),
        "votes_against": str(rng.randint(0, votes_for - 1)),
        "score_a": str(score_a),
        "score_b": str(rng.randint(0, score_a - 1)),
        "crowd": str(rng.randint(2, 60) * 1000),
        "storm": rng.choice(STORMS),
        "speed": str(rng.randint(60, 190)),
        "rain": str(rng.randint(20, 300)),
    }


def _filler(rng: random.Random, template: str, fields: dict[str, str]) -> str:
    extra = {
        "person2": _person(rng),
        "place2": rng.choice([p for p in PLACES if p != fields["place"]]),
        "adj": rng.choice(ADJECTIVES),
        "n2": str(rng.randint(2, 400)),
        "pct": str(rng.randint(5, 95)),
        "month": rng.choice(MONTHS),
        "ordinal": rng.choice(ORDINALS),
    }
    return template.format(**fields, **extra)


def make_example(rng: random.Random) -> dict[str, str]:
    """One synthetic article and its highlights."""
    topic = TOPICS[rng.choice(sorted(TOPICS))]
    fields = _fields(rng, topic)
    lead = rng.choice(topic["lead"]).format(**fields)
    fact = rng.choice(topic["fact"]).format(**fields)
    target_words = int(rng.lognormvariate(_LENGTH_MU, _LENGTH_SIGMA))
    target_words = min(max(target_words, _MIN_WORDS), _MAX_WORDS)

    sentences = [lead]
    # Walk the filler templates in a shuffled cycle: long articles repeat a template only after using all.
    order = rng.sample(FILLER, len(FILLER))
    fact_at = rng.choice((1, 2))  # second or third sentence
    words = len(lead.split()) + len(fact.split())
    while len(sentences) < fact_at or words < target_words:
        if len(sentences) == fact_at:
            sentences.append(fact)
            continue
        filler = _filler(rng, order[len(sentences) % len(order)], fields)
        if words + len(filler.split()) > _MAX_WORDS:
            break
        sentences.append(filler)
        words += len(filler.split())
    if fact not in sentences:
        sentences.insert(min(fact_at, len(sentences)), fact)

    highlights = f"{topic['hl_lead'].format(**fields)} {topic['hl_fact'].format(**fields)}"
    return {"article": " ".join(sentences), "highlights": highlights}


SAMPLES = SampleGenerator("news_summaries", make_example, SEED, NUM_TRAIN, NUM_VALIDATION)
# generate(seed=SEED): all splits as lists of rows; write(out_dir, seed=SEED): their {split}.jsonl files.
generate, write = SAMPLES.generate, SAMPLES.write

if __name__ == "__main__":
    SAMPLES.main()
