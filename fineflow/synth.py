"""The bundled synthetic instruction dataset and the pretraining corpus of the embedded base model.

Four task families a tiny model can learn on CPU in minutes — field extraction, date formatting, picking
the larger number, reversing a word list — all copy-and-reorder skills, so held-out rows are new
combinations of the same vocabulary. The pretraining corpus states the same facts as prose (no instruction
template), which gives the base model the vocabulary and copying ability that LoRA then adapts to the
instruction format.

Everything is a pure function of a seed: the same seed gives byte-identical files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

NAMES = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena",
         "Yusuf", "Zara", "Arjun", "Beatriz", "Cyril", "Dmitri", "Elif", "Finn"]
CITIES = ["Paris", "Lagos", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Dublin", "Accra", "Seoul",
          "Porto", "Riga", "Kyoto", "Perth", "Tunis", "Bern", "Delhi", "Minsk", "Sofia", "Turin", "Nairobi",
          "Austin", "Havana"]
JOBS = ["baker", "pilot", "nurse", "chemist", "farmer", "lawyer", "painter", "tailor", "editor", "welder",
        "dentist", "teacher"]
WORDS = ["red", "blue", "green", "stone", "river", "cloud", "apple", "tiger", "lamp", "bread", "glass", "wolf",
         "moon", "sand", "rope", "salt", "fern", "iron", "milk", "owl", "pearl", "reed", "snow", "vine"]
FIELDS = ["name", "city", "age", "job"]


@dataclass(frozen=True)
class Example:
    instruction: str
    input: str
    output: str
    family: str


def _record(rng: random.Random) -> dict[str, str]:
    return {"name": rng.choice(NAMES), "city": rng.choice(CITIES), "age": str(rng.randint(18, 90)),
            "job": rng.choice(JOBS)}


def _record_text(rec: dict[str, str], rng: random.Random) -> str:
    keys = FIELDS[:]
    rng.shuffle(keys)
    return "; ".join(f"{k}={rec[k]}" for k in keys)


def _date(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)


def extract_field(rng: random.Random) -> Example:
    rec, field = _record(rng), rng.choice(FIELDS)
    return Example(f"Extract the {field} from the record.", _record_text(rec, rng), rec[field], "extract")


def format_date(rng: random.Random) -> Example:
    y, m, d = _date(rng)
    return Example("Rewrite the date as DD/MM/YYYY.", f"{y:04d}-{m:02d}-{d:02d}", f"{d:02d}/{m:02d}/{y:04d}",
                   "date")


def larger_number(rng: random.Random) -> Example:
    a, b = rng.sample(range(10, 1000), 2)
    return Example("Which number is larger?", f"{a} or {b}", str(max(a, b)), "compare")


def reverse_words(rng: random.Random) -> Example:
    words = rng.sample(WORDS, 3)
    return Example("Reverse the order of the words.", " ".join(words), " ".join(reversed(words)), "reverse")


FAMILIES: list[Callable[[random.Random], Example]] = [extract_field, format_date, larger_number, reverse_words]


def generate_examples(n: int, seed: int) -> list[Example]:
    """n well-formed examples, families interleaved, deterministic in seed."""
    rng = random.Random(seed)
    return [FAMILIES[i % len(FAMILIES)](rng) for i in range(n)]


def as_row(ex: Example) -> dict[str, str]:
    return {"instruction": ex.instruction, "input": ex.input, "output": ex.output}


def split_train_eval(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train/eval rows: an eval row never appears (instruction+input) in train."""
    pool = generate_examples(4 * (n_train + n_eval), seed)
    seen: set[tuple[str, str]] = set()
    unique: list[dict] = []
    for ex in pool:
        key = (ex.instruction, ex.input)
        if key not in seen:
            seen.add(key)
            unique.append(as_row(ex))
        if len(unique) == n_train + n_eval:
            break
    return unique[:n_train], unique[n_train:]


BAD_KINDS = ("missing_field", "empty_output", "over_long", "duplicate", "email", "phone", "card",
             "near_duplicate", "eval_leak")


def inject_bad_rows(rows: list[dict], share: float, seed: int, eval_rows: list[dict] | None = None) -> list[dict]:
    """Return rows with ~share deliberately bad rows mixed in, one of each kind before repeating.

    Kinds (BAD_KINDS): a missing field, an empty output, an over-long input, an exact duplicate, PII (an
    e-mail address, a phone number, a Luhn-valid card number), a near-duplicate (same text up to case and
    punctuation; a warning by default) and a row copied from the eval split (leakage).
    """
    rng = random.Random(seed + 1)
    kinds = [k for k in BAD_KINDS if k != "eval_leak" or eval_rows]
    n_bad = max(len(kinds), round(len(rows) * share)) if share > 0 else 0
    out = [dict(r) for r in rows]
    for i in range(n_bad):
        victim = dict(rng.choice(rows))
        kind = kinds[i % len(kinds)]
        if kind == "missing_field":
            victim.pop("output")
        elif kind == "empty_output":
            victim["output"] = ""
        elif kind == "over_long":
            victim["input"] = " ".join(rng.choice(WORDS) for _ in range(800))
        elif kind == "email":
            victim["input"] = f"contact {rng.choice(NAMES).lower()}@example.com; " + victim["input"]
        elif kind == "phone":
            victim["input"] = f"call +1 415 555 {rng.randint(1000, 9999)}; " + victim["input"]
        elif kind == "card":
            victim["input"] = "paid with 4111 1111 1111 1111; " + victim["input"]
        elif kind == "near_duplicate":
            victim["instruction"] = victim["instruction"].upper().rstrip(".?") + "!"
        elif kind == "eval_leak":
            victim = dict(rng.choice(eval_rows))
        out.insert(rng.randrange(len(out) + 1), victim)  # "duplicate": the victim unchanged
    return out


def _prose(rng: random.Random) -> str:
    """One pretraining document: the task families' facts, stated without the instruction template."""
    kind = rng.randrange(4)
    if kind == 0:
        rec = _record(rng)
        text = _record_text(rec, rng)
        field = rng.choice(FIELDS)
        return f"Record {text}. Its {field} is {rec[field]}. {rec['name']} is a {rec['job']} in {rec['city']}."
    if kind == 1:
        y, m, d = _date(rng)
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
