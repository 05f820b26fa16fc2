"""A multi-document QA set generated from a seed: facts planted in documents, distractors, short answers.

Every document describes one fictional organisation with four attributes (founding year,
city, director, code word) wrapped in filler sentences (about 150 tokens). Each question asks
for one attribute of one organisation and comes with its document plus distractor documents
about other organisations, in a shuffled order.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ["kes", "trel", "var", "nen", "mor", "dax", "li", "quen", "tor", "bel", "ran", "sil", "ot", "fen",
             "gar", "zu", "pel", "mir", "hal", "cor"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec", "Tbilisi", "Perth", "Valencia", "Dakar",
          "Krakow", "Osaka", "Denver", "Tunis", "Bergen", "Cusco"]
FIRST = ["Maria", "Tomas", "Aiko", "Samuel", "Leila", "Viktor", "Nadia", "Owen", "Priya", "Jonas", "Elena", "Kofi"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Castillo", "Brennan", "Sato", "Adeyemi"]
WORDS = ["amber", "falcon", "granite", "willow", "comet", "harbor", "lantern", "maple", "orchid", "quartz",
         "saffron", "thistle", "velvet", "zephyr", "cobalt", "juniper"]
FILLER = [
    "The organisation publishes a short report every spring.",
    "Its staff meet every Monday to review open work.",
    "Visitors are welcome on the first Friday of each month.",
    "The archive holds letters, photographs and old maps.",
    "Several partner groups share its main building.",
    "A newsletter goes out to members twice a year.",
    "Volunteers help with events and guided tours.",
    "Its budget is reviewed by an independent board.",
    "Most of its projects run for two or three years.",
    "The library on the ground floor is open to the public.",
    "New members join after a short interview.",
    "Its annual meeting usually takes place in late autumn.",
    "Several of its early papers are still cited today.",
    "The website lists upcoming talks and workshops.",
]
QUESTIONS = {
    "year": ("In which year was {name} founded?", "{year}"),
    "city": ("In which city is {name} based?", "{city}"),
    "director": ("Who is the director of {name}?", "{director}"),
    "code": ("What is the code word of {name}?", "{code}"),
}


@dataclass(slots=True, frozen=True)
class Question:
    question: str
    answer: str
    documents: tuple[str, ...]      # shuffled; one of them holds the answer
    gold: int                       # index of the answering document in `documents`


def organisation(rng: random.Random) -> dict:
    name = "the " + "".join(rng.sample(SYLLABLES, 2)).capitalize() + " " + rng.choice(["Institute", "Society", "Guild", "Foundation"])
    return {"name": name, "year": str(rng.randint(1890, 2015)), "city": rng.choice(CITIES),
            "director": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "code": rng.choice(WORDS)}


def document(org: dict, rng: random.Random) -> str:
    title = org["name"][0].upper() + org["name"][1:]
    facts = [f"{title} was founded in {org['year']}.",
             f"It is based in the city of {org['city']}.",
             f"Its director is {org['director']}.",
             f"The code word of {org['name']} is {org['code']}."]
    filler = rng.sample(FILLER, 11)
    sentences = [facts[0], filler[0], filler[1], facts[1], filler[2], filler[3], filler[4], facts[2], filler[5],
                 filler[6], facts[3], filler[7], filler[8], filler[9], filler[10]]
    return " ".join(sentences)


def build(seed: int = 0, organisations: int = 50, docs_per_question: int = 5) -> tuple[list[str], list[Question]]:
    """The document pool and one question per (organisation, attribute)."""
    rng = random.Random(seed)
    orgs, seen = [], set()
    while len(orgs) < organisations:
        org = organisation(rng)
        if org["name"] not in seen:
            seen.add(org["name"])
            orgs.append(org)
    docs = [document(org, rng) for org in orgs]
    questions = []
    for i, org in enumerate(orgs):
        for template, answer in QUESTIONS.values():
            others = rng.sample([j for j in range(len(orgs)) if j != i], docs_per_question - 1)
            order = others + [i]
            rng.shuffle(order)
            questions.append(Question(template.format(**org), answer.format(**org),
                                      tuple(docs[j] for j in order), order.index(i)))
    rng.shuffle(questions)
    return docs, questions
