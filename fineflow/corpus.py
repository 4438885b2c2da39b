"""The bundled world of the synthetic data — names, cities, words — and the embedded base model's
pretraining corpus, which states the task families' facts as prose (no instruction template).

Kept apart from fineflow.data.synth (the instruction dataset) so that editing the dataset generator does not
re-run the base stage's pretraining: ``dvc.yaml`` lists only this module for the base stage.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NAMES = [
    "Alice",
    "Bruno",
    "Chen",
    "Dalia",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Jia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Viktor",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zara",
    "Arjun",
    "Beatriz",
    "Cyril",
    "Dmitri",
    "Elif",
    "Finn",
]
CITIES = [
    "Paris",
    "Lagos",
    "Tokyo",
    "Lima",
    "Oslo",
    "Cairo",
    "Quito",
    "Hanoi",
    "Dublin",
    "Accra",
    "Seoul",
    "Porto",
    "Riga",
    "Kyoto",
    "Perth",
    "Tunis",
    "Bern",
    "Delhi",
    "Minsk",
    "Sofia",
    "Turin",
    "Nairobi",
    "Austin",
    "Havana",
]
JOBS = [
    "baker",
    "pilot",
    "nurse",
    "chemist",
    "farmer",
    "lawyer",
    "painter",
    "tailor",
    "editor",
    "welder",
    "dentist",
    "teacher",
]
WORDS = [
    "red",
    "blue",
    "green",
    "stone",
    "river",
    "cloud",
    "apple",
    "tiger",
    "lamp",
    "bread",
    "glass",
    "wolf",
    "moon",
    "sand",
    "rope",
    "salt",
    "fern",
    "iron",
    "milk",
    "owl",
    "pearl",
    "reed",
    "snow",
    "vine",
]
FIELDS = ["name", "city", "age", "job"]


def record(rng: random.Random) -> dict[str, str]:
    return {
        "name": rng.choice(NAMES),
        "city": rng.choice(CITIES),
        "age": str(rng.randint(18, 90)),
        "job": rng.choice(JOBS),
    }


def record_text(rec: dict[str, str], rng: random.Random) -> str:
    keys = FIELDS[:]
    rng.shuffle(keys)
    return "; ".join(f"{k}={rec[k]}" for k in keys)


def date_parts(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)


def _prose(rng: random.Random) -> str:
    """One pretraining document: the task families' facts, stated without the instruction template."""
    kind = rng.randrange(4)
    if kind == 0:
        rec = record(rng)
        text = record_text(rec, rng)
        field = rng.choice(FIELDS)
        return f"Record {text}. Its {field} is {rec[field]}. {rec['name']} is a {rec['job']} in {rec['city']}."
    if kind == 1:
        y, m, d = date_parts(rng)
        return f"The date {y:04d}-{m:02d}-{d:02d} is written {d:02d}/{m:02d}/{y:04d} in Europe."
    if kind == 2:
        a, b = rng.sample(range(10, 1000), 2)
        return f"Between {a} and {b} the larger is {max(a, b)} and the smaller is {min(a, b)}."
    words = rng.sample(WORDS, 3)
    return f"The words {' '.join(words)} backwards are {' '.join(reversed(words))}."


def pretraining_corpus(n_docs: int, seed: int) -> Iterator[str]:
    """Deterministic prose documents for the embedded base model's tokenizer and pretraining."""
    rng = random.Random(seed + 7)
    for _ in range(n_docs):
        yield _prose(rng)
